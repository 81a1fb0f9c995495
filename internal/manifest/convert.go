package manifest

import (
	"encoding/json"
	"math"
	"sort"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// secretFields are never quoted in error messages.
var secretFields = map[protoreflect.FullName]bool{
	"kiln.types.v1.BMCSpec.password": true,
}

// converter walks YAML nodes along a message descriptor, checking names
// and types, and produces the JSON value protojson expects.
type converter struct {
	file  string
	errs  *Error
	lines map[string]int
	// budget is how many more values the walk may visit. YAML aliases
	// (*x) are followed, so a small document can stand for a huge one:
	// kilnctl once took 3.4 GB on a 14 MB file of aliases. newConverter
	// sets it to what the document visits as written plus aliasExtra.
	budget    int
	exhausted bool
}

// aliasExtra bounds how many values a document's aliases may add to it
// (some 200 MB of work at most). A document visits at most two values
// per node as written, so one without aliases never reaches the bound.
const aliasExtra = 1_000_000

func newConverter(file string, errs *Error, lines map[string]int, root *yaml.Node) *converter {
	return &converter{file: file, errs: errs, lines: lines, budget: 2*countNodes(root) + aliasExtra}
}

// countNodes counts the nodes of a document as written: aliases are not
// followed.
func countNodes(n *yaml.Node) int {
	if n == nil {
		return 0
	}
	c := 1
	for _, e := range n.Content {
		c += countNodes(e)
	}
	return c
}

// spend takes one value from the budget; once it is spent the walk fails,
// once, naming where.
func (c *converter) spend(n *yaml.Node, path string) bool {
	c.budget--
	if c.budget >= 0 {
		return true
	}
	if !c.exhausted {
		c.exhausted = true
		c.fail(n, path, "the document's aliases (*name) add more than %d values to it: write the values out, or reuse fewer anchors", aliasExtra)
	}
	return false
}

func (c *converter) fail(n *yaml.Node, path, format string, args ...any) {
	c.errs.Add(c.file, n.Line, path, format, args...)
}

// value converts the node of field fd (a whole list or map, or a single
// value) found at path. A YAML null leaves the field unset (nil, true).
func (c *converter) value(n *yaml.Node, fd protoreflect.FieldDescriptor, path string) (any, bool) {
	n = deref(n)
	if !c.spend(n, path) {
		return nil, false
	}
	if n.ShortTag() == "!!null" {
		return nil, true
	}
	switch {
	case fd.IsList():
		if n.Kind != yaml.SequenceNode {
			c.fail(n, path, "want a list, got %s", describe(n))
			return nil, false
		}
		out := make([]any, 0, len(n.Content))
		ok := true
		for i, e := range n.Content {
			p := path + "[" + strconv.Itoa(i) + "]"
			c.lines[p] = e.Line
			v, good := c.single(deref(e), fd, p)
			ok = ok && good
			out = append(out, v)
		}
		return out, ok
	case fd.IsMap():
		if n.Kind != yaml.MappingNode {
			c.fail(n, path, "want a mapping of keys to values, got %s", describe(n))
			return nil, false
		}
		out := make(map[string]any, len(n.Content)/2)
		ok := true
		seen := map[string]int{}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := deref(n.Content[i]), deref(n.Content[i+1])
			if k.Kind != yaml.ScalarNode {
				c.fail(k, path, "want a plain key, got %s", describe(k))
				ok = false
				continue
			}
			p := path + "." + k.Value
			if first, dup := seen[k.Value]; dup {
				c.fail(k, p, "duplicate key (first at line %d)", first)
				ok = false
				continue
			}
			seen[k.Value] = k.Line
			c.lines[p] = k.Line
			val, good := c.mapValue(v, fd.MapValue(), p)
			ok = ok && good
			out[k.Value] = val
		}
		return out, ok
	}
	return c.single(n, fd, path)
}

// mapValue converts a map value. Label-like string maps take any scalar
// (`upgrade-wave: 1` means "1"), as a user would expect.
func (c *converter) mapValue(n *yaml.Node, fd protoreflect.FieldDescriptor, path string) (any, bool) {
	if fd.Kind() == protoreflect.StringKind {
		if n.Kind != yaml.ScalarNode {
			c.fail(n, path, "want a string, got %s", describe(n))
			return nil, false
		}
		if n.ShortTag() == "!!null" {
			return "", true
		}
		return n.Value, true
	}
	return c.single(n, fd, path)
}

// single converts one value of fd's type (an element of a list, or a
// singular field).
func (c *converter) single(n *yaml.Node, fd protoreflect.FieldDescriptor, path string) (any, bool) {
	if !c.spend(n, path) {
		return nil, false
	}
	tag := n.ShortTag()
	if secretFields[fd.FullName()] && (n.Kind != yaml.ScalarNode || (tag != "!!str" && tag != "!!null")) {
		// Never echo a secret, even a mistyped one.
		c.fail(n, path, "want a string: quote the value")
		return nil, false
	}
	if fd.Kind() != protoreflect.MessageKind && fd.Kind() != protoreflect.GroupKind && n.Kind != yaml.ScalarNode {
		c.fail(n, path, "want %s, got %s", want(fd), describe(n))
		return nil, false
	}
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		if fd.Message().FullName() == "google.protobuf.Timestamp" {
			if n.Kind != yaml.ScalarNode || (tag != "!!str" && tag != "!!timestamp") {
				c.fail(n, path, "want an RFC 3339 time such as 2026-12-02T13:00:00Z, got %s", describe(n))
				return nil, false
			}
			return n.Value, true
		}
		return c.message(n, fd.Message(), path)
	case protoreflect.StringKind:
		switch {
		case tag == "!!str", tag == "!!timestamp":
			return n.Value, true
		case tag == "!!int" && intOrPercent[fd.FullName()]:
			return n.Value, true
		}
		c.fail(n, path, "want a string, got %s: quote it (\"%s\")", describe(n), n.Value)
		return nil, false
	case protoreflect.BoolKind:
		var b bool
		if tag != "!!bool" || n.Decode(&b) != nil {
			c.fail(n, path, "want true or false, got %s", describe(n))
			return nil, false
		}
		return b, true
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind,
		protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		var i int64
		if tag != "!!int" || n.Decode(&i) != nil {
			c.fail(n, path, "want an integer, got %s", describe(n))
			return nil, false
		}
		if is32(fd.Kind()) && (i < math.MinInt32 || i > math.MaxInt32) {
			c.fail(n, path, "%d is out of range for a 32-bit integer", i)
			return nil, false
		}
		return json.Number(strconv.FormatInt(i, 10)), true
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind, protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		var u uint64
		if tag != "!!int" || n.Decode(&u) != nil {
			c.fail(n, path, "want a non-negative integer, got %s", describe(n))
			return nil, false
		}
		if (fd.Kind() == protoreflect.Uint32Kind || fd.Kind() == protoreflect.Fixed32Kind) && u > math.MaxUint32 {
			c.fail(n, path, "%d is out of range for a 32-bit integer", u)
			return nil, false
		}
		return json.Number(strconv.FormatUint(u, 10)), true
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		var f float64
		if (tag != "!!float" && tag != "!!int") || n.Decode(&f) != nil {
			c.fail(n, path, "want a number, got %s", describe(n))
			return nil, false
		}
		return f, true
	case protoreflect.EnumKind:
		// The API's word (Provisioned), or the proto name
		// (HOST_STATE_PROVISIONED) that kilnctl once printed.
		values := fd.Enum().Values()
		if tag == "!!str" {
			if values.ByName(protoreflect.Name(n.Value)) != nil {
				return n.Value, true
			}
			for i := 0; i < values.Len(); i++ {
				if EnumWord(values.Get(i)) == n.Value {
					return string(values.Get(i).Name()), true
				}
			}
		}
		var words []string
		for i := 0; i < values.Len(); i++ {
			if values.Get(i).Number() != 0 {
				words = append(words, EnumWord(values.Get(i)))
			}
		}
		c.fail(n, path, "%q is not one of %s", n.Value, strings.Join(words, ", "))
		return nil, false
	}
	c.fail(n, path, "fields of type %v cannot be set from YAML", fd.Kind())
	return nil, false
}

// message converts a mapping node into the JSON object of md.
func (c *converter) message(n *yaml.Node, md protoreflect.MessageDescriptor, path string) (any, bool) {
	if n.Kind != yaml.MappingNode {
		c.fail(n, path, "want a mapping of fields, got %s", describe(n))
		return nil, false
	}
	out := make(map[string]any, len(n.Content)/2)
	ok := true
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := deref(n.Content[i]), n.Content[i+1]
		p := join(path, k.Value)
		if k.Kind != yaml.ScalarNode {
			c.fail(k, path, "want a field name, got %s", describe(k))
			ok = false
			continue
		}
		fd := md.Fields().ByJSONName(k.Value)
		if fd == nil {
			c.fail(k, p, "%s", unknownField(k.Value, md))
			ok = false
			continue
		}
		if first, dup := seen[k.Value]; dup {
			c.fail(k, p, "duplicate field (first at line %d)", first)
			ok = false
			continue
		}
		seen[k.Value] = k.Line
		c.lines[p] = k.Line
		val, good := c.value(v, fd, p)
		ok = ok && good
		if val != nil {
			out[fd.JSONName()] = val
		}
	}
	return out, ok
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func deref(n *yaml.Node) *yaml.Node {
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	return n
}

func is32(k protoreflect.Kind) bool {
	return k == protoreflect.Int32Kind || k == protoreflect.Sint32Kind || k == protoreflect.Sfixed32Kind
}

// describe names what a node holds, for "want X, got Y" messages.
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	switch n.ShortTag() {
	case "!!int", "!!float":
		return "the number " + n.Value
	case "!!bool":
		return "the boolean " + n.Value
	case "!!null":
		return "null"
	}
	return strconv.Quote(n.Value)
}

func want(fd protoreflect.FieldDescriptor) string {
	switch fd.Kind() {
	case protoreflect.StringKind:
		return "a string"
	case protoreflect.BoolKind:
		return "true or false"
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		return "a number"
	case protoreflect.EnumKind:
		return "a name"
	}
	return "an integer"
}

// unknownField says a key is not a field of md, suggesting the closest
// field name.
func unknownField(key string, md protoreflect.MessageDescriptor) string {
	names := make([]string, md.Fields().Len())
	for i := range names {
		names[i] = md.Fields().Get(i).JSONName()
	}
	if s := suggest(key, names); s != "" {
		return "unknown field (did you mean " + s + "?)"
	}
	sort.Strings(names)
	return "unknown field: " + string(md.Name()) + " has " + strings.Join(names, ", ")
}

// suggest returns the name in names closest to key: equal but for case,
// '_' and '-', or within a small edit distance. "" when none is close.
func suggest(key string, names []string) string {
	norm := func(s string) string {
		return strings.ToLower(strings.NewReplacer("_", "", "-", "").Replace(s))
	}
	for _, n := range names {
		if norm(n) == norm(key) {
			return n
		}
	}
	best, bestD := "", 3
	if len(key) <= 4 {
		bestD = 2
	}
	for _, n := range names {
		if d := editDistance(norm(key), norm(n)); d < bestD {
			best, bestD = n, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance of a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
