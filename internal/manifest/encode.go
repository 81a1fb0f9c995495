package manifest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Object returns the message r holds (a *typesv1.Host, ...) with
// apiVersion and kind filled in when the stored object lacks them. The
// result is a copy. An empty Resource is InvalidArgument.
func Object(r *controllerv1.Resource) (proto.Message, error) {
	od := r.ProtoReflect().Descriptor().Oneofs().ByName("kind")
	fd := r.ProtoReflect().WhichOneof(od)
	if fd == nil {
		return nil, errdefs.InvalidArgument("resource holds no object")
	}
	m := proto.Clone(r.ProtoReflect().Get(fd).Message().Interface())
	pm := m.ProtoReflect()
	fields := pm.Descriptor().Fields()
	if f := fields.ByName("api_version"); f != nil && pm.Get(f).String() == "" {
		pm.Set(f, protoreflect.ValueOfString(APIVersion))
	}
	if f := fields.ByName("kind"); f != nil && pm.Get(f).String() == "" {
		pm.Set(f, protoreflect.ValueOfString(string(pm.Descriptor().Name())))
	}
	return m, nil
}

// Marshal returns r as one YAML document: apiVersion, kind, metadata,
// spec and status in that order, fields in declaration order with their
// JSON names, unset fields left out. Decode reads it back.
func Marshal(r *controllerv1.Resource) ([]byte, error) {
	m, err := Object(r)
	if err != nil {
		return nil, err
	}
	return MarshalMessage(m)
}

// MarshalMessage returns any message (a spec, a status) as YAML with the
// rules of Marshal. An empty message is "{}\n".
func MarshalMessage(m proto.Message) ([]byte, error) {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(messageNode(m.ProtoReflect())); err != nil {
		return nil, fmt.Errorf("manifest: encode yaml: %w", err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("manifest: encode yaml: %w", err)
	}
	return buf.Bytes(), nil
}

// MarshalAll returns resources as a YAML stream, documents separated by
// "---".
func MarshalAll(rs []*controllerv1.Resource) ([]byte, error) {
	var parts [][]byte
	for _, r := range rs {
		b, err := Marshal(r)
		if err != nil {
			return nil, err
		}
		parts = append(parts, b)
	}
	return bytes.Join(parts, []byte("---\n")), nil
}

// MarshalJSON returns the object r holds as indented JSON: the document
// Marshal writes, in the same order and with the same words (enums by
// their short word, times in RFC 3339, 64-bit integers as numbers), so
// YAML and JSON output say the same thing and both apply again.
func MarshalJSON(r *controllerv1.Resource) ([]byte, error) {
	m, err := Object(r)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	if err := writeJSON(&buf, messageNode(m.ProtoReflect()), ""); err != nil {
		return nil, fmt.Errorf("manifest: encode json: %w", err)
	}
	buf.WriteByte('\n')
	return buf.Bytes(), nil
}

// writeJSON writes the node tree messageNode builds as JSON indented by
// two spaces per level, keys in the tree's order.
func writeJSON(buf *bytes.Buffer, n *yaml.Node, indent string) error {
	inner := indent + "  "
	switch n.Kind {
	case yaml.MappingNode:
		if len(n.Content) == 0 {
			buf.WriteString("{}")
			return nil
		}
		buf.WriteString("{")
		for i := 0; i+1 < len(n.Content); i += 2 {
			if i > 0 {
				buf.WriteString(",")
			}
			buf.WriteString("\n" + inner)
			if err := writeJSONString(buf, n.Content[i].Value); err != nil {
				return err
			}
			buf.WriteString(": ")
			if err := writeJSON(buf, n.Content[i+1], inner); err != nil {
				return err
			}
		}
		buf.WriteString("\n" + indent + "}")
	case yaml.SequenceNode:
		if len(n.Content) == 0 {
			buf.WriteString("[]")
			return nil
		}
		buf.WriteString("[")
		for i, e := range n.Content {
			if i > 0 {
				buf.WriteString(",")
			}
			buf.WriteString("\n" + inner)
			if err := writeJSON(buf, e, inner); err != nil {
				return err
			}
		}
		buf.WriteString("\n" + indent + "]")
	default:
		switch n.Tag {
		case "!!bool", "!!int":
			buf.WriteString(n.Value)
		case "!!float":
			if f, err := strconv.ParseFloat(n.Value, 64); err != nil || math.IsInf(f, 0) || math.IsNaN(f) {
				// JSON has no NaN or infinity; protojson writes them as
				// strings too.
				return writeJSONString(buf, n.Value)
			}
			buf.WriteString(n.Value)
		default:
			return writeJSONString(buf, n.Value)
		}
	}
	return nil
}

func writeJSONString(buf *bytes.Buffer, s string) error {
	enc := json.NewEncoder(buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(s); err != nil {
		return err
	}
	buf.Truncate(buf.Len() - 1) // Encode ends with a newline
	return nil
}

func messageNode(m protoreflect.Message) *yaml.Node {
	n := &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
	fields := m.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if !m.Has(fd) {
			continue
		}
		v := m.Get(fd)
		var vn *yaml.Node
		switch {
		case fd.IsList():
			l := v.List()
			vn = &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
			for j := 0; j < l.Len(); j++ {
				vn.Content = append(vn.Content, scalarNode(fd, l.Get(j)))
			}
		case fd.IsMap():
			mp := v.Map()
			keys := make([]string, 0, mp.Len())
			mp.Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
				keys = append(keys, k.String())
				return true
			})
			sort.Strings(keys)
			vn = &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
			for _, k := range keys {
				val := mp.Get(protoreflect.ValueOfString(k).MapKey())
				vn.Content = append(vn.Content, strNode(k), scalarNode(fd.MapValue(), val))
			}
		default:
			vn = scalarNode(fd, v)
		}
		n.Content = append(n.Content, strNode(fd.JSONName()), vn)
	}
	return n
}

func scalarNode(fd protoreflect.FieldDescriptor, v protoreflect.Value) *yaml.Node {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		if fd.Message().FullName() == "google.protobuf.Timestamp" {
			ts, _ := v.Message().Interface().(*timestamppb.Timestamp)
			return strNode(ts.AsTime().UTC().Format(time.RFC3339))
		}
		return messageNode(v.Message())
	case protoreflect.StringKind:
		return strNode(v.String())
	case protoreflect.BoolKind:
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!bool", Value: strconv.FormatBool(v.Bool())}
	case protoreflect.EnumKind:
		if ev := fd.Enum().Values().ByNumber(v.Enum()); ev != nil {
			return strNode(EnumWord(ev))
		}
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!int", Value: strconv.Itoa(int(v.Enum()))}
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!float", Value: strconv.FormatFloat(v.Float(), 'g', -1, 64)}
	case protoreflect.BytesKind:
		return strNode(fmt.Sprintf("%x", v.Bytes()))
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind, protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!int", Value: strconv.FormatUint(v.Uint(), 10)}
	}
	return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!int", Value: strconv.FormatInt(v.Int(), 10)}
}

// strNode is a string scalar; multi-line strings (PEM) are literal blocks.
func strNode(s string) *yaml.Node {
	n := &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: s}
	switch {
	case strings.Contains(s, "\n"):
		n.Style = yaml.LiteralStyle
	case yaml11Bool[strings.ToLower(s)]:
		// YAML 1.1 readers (and people) take these for booleans.
		n.Style = yaml.DoubleQuotedStyle
	}
	return n
}

// EnumWord returns the word the API uses for an enum value, as tables
// show it: the value's name without the enum's prefix, in CamelCase
// (HOST_STATE_PROVISIONED of HostState is "Provisioned"). Decode takes
// both the word and the full name.
func EnumWord(ev protoreflect.EnumValueDescriptor) string {
	name := string(ev.Name())
	if e, ok := ev.Parent().(protoreflect.EnumDescriptor); ok {
		name = strings.TrimPrefix(name, upperSnake(string(e.Name()))+"_")
	}
	var b strings.Builder
	for _, w := range strings.Split(name, "_") {
		if w == "" {
			continue
		}
		b.WriteString(w[:1])
		b.WriteString(strings.ToLower(w[1:]))
	}
	if b.Len() == 0 {
		return name
	}
	return b.String()
}

// upperSnake turns an enum's type name into the prefix protobuf style
// gives its values: HostState is HOST_STATE, BMCProtocol is BMC_PROTOCOL.
func upperSnake(s string) string {
	var b strings.Builder
	for i, r := range s {
		if i > 0 && unicode.IsUpper(r) {
			prev := rune(s[i-1])
			nextLower := i+1 < len(s) && unicode.IsLower(rune(s[i+1]))
			if unicode.IsLower(prev) || unicode.IsDigit(prev) || (unicode.IsUpper(prev) && nextLower) {
				b.WriteByte('_')
			}
		}
		b.WriteRune(unicode.ToUpper(r))
	}
	return b.String()
}

var yaml11Bool = map[string]bool{"y": true, "yes": true, "n": true, "no": true, "on": true, "off": true}
