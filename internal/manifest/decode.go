// Package manifest reads Kiln resources from YAML files and writes them
// back as YAML. Decoding is strict: every key is checked against the
// resource's protobuf descriptor, and every problem is reported with the
// file, the line and the field path, e.g.
//
//	examples/lab.yaml:14: spec.podCIDR: unknown field (did you mean podCidr?)
//
// Field names are protojson's lowerCamelCase JSON names (podCidr,
// kubernetesVersion, maxSurge). Each document has apiVersion kiln.dev/v1,
// a kind (Host, Image, Cluster, ControlPlane, MachineDeployment, Machine,
// HealthCheck), metadata and spec; status is accepted and ignored, so the
// output of `kilnctl get -o yaml` can be applied again.
package manifest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// APIVersion is the apiVersion every document must carry.
const APIVersion = "kiln.dev/v1"

// Document is one resource read from a file, with the lines its fields
// came from.
type Document struct {
	// File is the file name as given ("-" for standard input).
	File string
	// Line is the line of the document's first key.
	Line int
	// Resource is the decoded resource; status is never set.
	Resource *controllerv1.Resource
	// lines maps field paths ("spec.bmc.address") to their lines.
	lines map[string]int
}

// FieldLine returns the line of field path (as validation names it:
// "spec.strategy.maxSurge", "spec.unhealthyConditions[0].timeout"), or of
// its nearest parent that appears in the file, or the document's line.
func (d *Document) FieldLine(path string) int {
	for p := path; p != ""; {
		if l, ok := d.lines[p]; ok {
			return l
		}
		i := strings.LastIndexAny(p, ".[")
		if i < 0 {
			break
		}
		p = p[:i]
	}
	return d.Line
}

// Problem is one thing wrong in a file.
type Problem struct {
	File  string
	Line  int
	Field string // may be empty
	Msg   string
}

func (p Problem) String() string {
	loc := p.File
	if p.Line > 0 {
		loc += ":" + strconv.Itoa(p.Line)
	}
	if p.Field == "" {
		return loc + ": " + p.Msg
	}
	return loc + ": " + p.Field + ": " + p.Msg
}

// Error lists every problem found in a set of files. It is of class
// errdefs.ErrInvalidArgument.
type Error struct {
	Problems []Problem
}

// Error returns one problem per line.
func (e *Error) Error() string {
	lines := make([]string, len(e.Problems))
	for i, p := range e.Problems {
		lines[i] = p.String()
	}
	return strings.Join(lines, "\n")
}

// Is makes errdefs.IsInvalidArgument(e) true.
func (e *Error) Is(target error) bool { return target == errdefs.ErrInvalidArgument }

// Add appends a problem at file:line (field may be empty).
func (e *Error) Add(file string, line int, field, format string, args ...any) {
	e.Problems = append(e.Problems, Problem{File: file, Line: line, Field: field, Msg: fmt.Sprintf(format, args...)})
}

func (e *Error) orNil() error {
	if len(e.Problems) == 0 {
		return nil
	}
	return e
}

// kindFields maps a kind name ("Host") to its field in Resource's oneof.
func kindFields() map[string]protoreflect.FieldDescriptor {
	od := (&controllerv1.Resource{}).ProtoReflect().Descriptor().Oneofs().ByName("kind")
	m := make(map[string]protoreflect.FieldDescriptor, od.Fields().Len())
	for i := 0; i < od.Fields().Len(); i++ {
		fd := od.Fields().Get(i)
		m[string(fd.Message().Name())] = fd
	}
	return m
}

// KindNames returns the kinds a document may have, in declaration order.
func KindNames() []string {
	od := (&controllerv1.Resource{}).ProtoReflect().Descriptor().Oneofs().ByName("kind")
	names := make([]string, od.Fields().Len())
	for i := range names {
		names[i] = string(od.Fields().Get(i).Message().Name())
	}
	return names
}

// intOrPercent are the string fields that also take a YAML integer.
var intOrPercent = map[protoreflect.FullName]bool{
	"kiln.types.v1.RolloutStrategy.max_surge":       true,
	"kiln.types.v1.RolloutStrategy.max_unavailable": true,
	"kiln.types.v1.HealthCheckSpec.max_unhealthy":   true,
}

// Decode parses data, the content of file, as a stream of YAML documents
// separated by "---". Empty documents are skipped. It returns an *Error
// listing every problem (class errdefs.InvalidArgument) when any document
// is bad. It does not run validation (see Load).
func Decode(file string, data []byte) ([]*Document, error) {
	var errs Error
	var docs []*Document
	dec := yaml.NewDecoder(bytes.NewReader(data))
	for {
		var n yaml.Node
		err := dec.Decode(&n)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			line, msg := yamlErrorLine(err)
			errs.Add(file, line, "", "%s", msg)
			break // the decoder cannot resume after a syntax error
		}
		doc := decodeDocument(file, &n, &errs)
		if doc != nil {
			docs = append(docs, doc)
		}
	}
	if err := errs.orNil(); err != nil {
		return nil, err
	}
	return docs, nil
}

// yamlErrorLine pulls "line N" out of a yaml.v3 error message.
func yamlErrorLine(err error) (int, string) {
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	if rest, ok := strings.CutPrefix(msg, "line "); ok {
		if num, tail, ok := strings.Cut(rest, ": "); ok {
			if l, err := strconv.Atoi(num); err == nil {
				// yaml.v3 reports a parser error at the 0-based line of
				// the construct it was parsing; scanner errors are
				// 1-based. Parser errors are the "did not find expected"
				// ones.
				if strings.HasPrefix(tail, "did not find expected") {
					l++
				}
				return l, "invalid YAML: " + tail
			}
		}
	}
	return 0, "invalid YAML: " + msg
}

func decodeDocument(file string, n *yaml.Node, errs *Error) *Document {
	root := n
	if root.Kind == yaml.DocumentNode {
		if len(root.Content) == 0 {
			return nil
		}
		root = root.Content[0]
	}
	if root.ShortTag() == "!!null" {
		return nil
	}
	if root.Kind != yaml.MappingNode {
		errs.Add(file, root.Line, "", "a document must be a mapping with apiVersion, kind, metadata and spec")
		return nil
	}
	before := len(errs.Problems)
	d := &Document{File: file, Line: root.Line, lines: map[string]int{}}
	var apiVersion, kind *yaml.Node
	fields := map[string]*yaml.Node{}
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		switch k.Value {
		case "apiVersion":
			apiVersion = v
		case "kind":
			kind = v
		case "metadata", "spec", "status":
			fields[k.Value] = v
		default:
			msg := "unknown field: a document has apiVersion, kind, metadata, spec and status"
			if s := suggest(k.Value, []string{"apiVersion", "kind", "metadata", "spec", "status"}); s != "" {
				msg = "unknown field (did you mean " + s + "?)"
			}
			errs.Add(file, k.Line, k.Value, "%s", msg)
			continue
		}
		d.lines[k.Value] = k.Line
	}
	switch {
	case apiVersion == nil:
		errs.Add(file, root.Line, "apiVersion", "required: use %s", APIVersion)
	case apiVersion.Value != APIVersion:
		errs.Add(file, apiVersion.Line, "apiVersion", "%q is not served: use %s", apiVersion.Value, APIVersion)
	}
	kinds := kindFields()
	var fd protoreflect.FieldDescriptor
	switch {
	case kind == nil:
		errs.Add(file, root.Line, "kind", "required: one of %s", strings.Join(KindNames(), ", "))
	case kinds[kind.Value] == nil:
		msg := fmt.Sprintf("unknown kind %q: use one of %s", kind.Value, strings.Join(KindNames(), ", "))
		if s := suggest(kind.Value, KindNames()); s != "" {
			msg = fmt.Sprintf("unknown kind %q (did you mean %s?)", kind.Value, s)
		}
		errs.Add(file, kind.Line, "kind", "%s", msg)
	default:
		fd = kinds[kind.Value]
	}
	if fd == nil {
		return nil
	}
	md := fd.Message()
	obj := map[string]any{"apiVersion": APIVersion, "kind": kind.Value}
	c := newConverter(file, errs, d.lines, root)
	for _, name := range []string{"metadata", "spec"} {
		v, ok := fields[name]
		if ok && deref(v).ShortTag() == "!!null" {
			// "spec:" with nothing after it is as good as no spec: one
			// decoded, it could not be written back (FuzzDecode).
			ok = false
		}
		if !ok {
			if name == "spec" {
				errs.Add(file, root.Line, "spec", "required")
			} else {
				errs.Add(file, root.Line, "metadata", "required: at least metadata.name")
			}
			continue
		}
		sub := md.Fields().ByJSONName(name)
		if val, ok := c.value(v, sub, name); ok && val != nil {
			obj[name] = val
		}
	}
	if len(errs.Problems) > before {
		return nil
	}
	b, err := json.Marshal(obj)
	if err != nil {
		errs.Add(file, root.Line, "", "encode: %v", err)
		return nil
	}
	msg := (&controllerv1.Resource{}).ProtoReflect().NewField(fd).Message().Interface()
	if err := protojson.Unmarshal(b, msg); err != nil {
		// The walk above checks every field, so this is a bug or a
		// corner it does not know; keep the position of the document.
		errs.Add(file, root.Line, "", "%v", err)
		return nil
	}
	r := &controllerv1.Resource{}
	r.ProtoReflect().Set(fd, protoreflect.ValueOfMessage(msg.ProtoReflect()))
	d.Resource = r
	return d
}

// UnmarshalMessage reads into m one message (a spec, a status) written by
// MarshalMessage or by MarshalJSON, with the checks of Decode: unknown
// fields and wrong types are an *Error (class errdefs.InvalidArgument)
// naming file and line. Enums take the API's word or the proto name.
func UnmarshalMessage(file string, data []byte, m proto.Message) error {
	var n yaml.Node
	if err := yaml.Unmarshal(data, &n); err != nil {
		line, msg := yamlErrorLine(err)
		errs := &Error{}
		errs.Add(file, line, "", "%s", msg)
		return errs
	}
	root := &n
	if root.Kind == yaml.DocumentNode {
		if len(root.Content) == 0 {
			return nil
		}
		root = root.Content[0]
	}
	errs := &Error{}
	c := newConverter(file, errs, map[string]int{}, root)
	val, ok := c.message(deref(root), m.ProtoReflect().Descriptor(), "")
	if !ok {
		return errs.orNil()
	}
	b, err := json.Marshal(val)
	if err != nil {
		return fmt.Errorf("manifest: encode: %w", err)
	}
	if err := protojson.Unmarshal(b, m); err != nil {
		errs.Add(file, root.Line, "", "%v", err)
		return errs
	}
	return nil
}
