// Package classvar holds the typed variables of a ClusterClass: checking a
// value against its declaration (integer, string, enum, cidr, with
// minimum and maximum), resolving a cluster's values with the class's
// defaults, and finding and substituting references to variables in the
// string fields of a class.
//
// A reference is written ${name} inside any string field (or label value)
// of the class's control-plane, worker and cluster templates, for example
// "image: ubuntu-${k8sMinor}" or "podCidr: ${podCidr}". $$ stands for a
// literal $. A name is a letter followed by letters, digits, '_' or '-'.
// It is pure: no I/O, no clock.
package classvar

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Variable types.
const (
	TypeInteger = "integer"
	TypeString  = "string"
	TypeEnum    = "enum"
	TypeCIDR    = "cidr"
)

// Types are the variable types, in the order messages list them.
var Types = []string{TypeInteger, TypeString, TypeEnum, TypeCIDR}

// CheckValue checks value against the declaration of v and returns what is
// wrong with it ("" when it is valid).
func CheckValue(v *typesv1.ClusterClassVariable, value string) string {
	switch v.GetType() {
	case TypeInteger:
		n, err := strconv.ParseInt(value, 10, 64)
		if err != nil {
			return fmt.Sprintf("%q is not an integer", value)
		}
		if v.Minimum != nil && n < v.GetMinimum() {
			return fmt.Sprintf("%d is below the minimum %d", n, v.GetMinimum())
		}
		if v.Maximum != nil && n > v.GetMaximum() {
			return fmt.Sprintf("%d is above the maximum %d", n, v.GetMaximum())
		}
	case TypeString:
		if v.Minimum != nil && int64(len(value)) < v.GetMinimum() {
			return fmt.Sprintf("%q is shorter than the minimum length %d", value, v.GetMinimum())
		}
		if v.Maximum != nil && int64(len(value)) > v.GetMaximum() {
			return fmt.Sprintf("%q is longer than the maximum length %d", value, v.GetMaximum())
		}
	case TypeEnum:
		if !slices.Contains(v.GetEnum(), value) {
			return fmt.Sprintf("%q is not one of %s", value, strings.Join(v.GetEnum(), ", "))
		}
	case TypeCIDR:
		p, err := netip.ParsePrefix(value)
		if err != nil {
			return fmt.Sprintf("%q is not a CIDR such as 10.244.0.0/16", value)
		}
		if p.Masked() != p {
			return fmt.Sprintf("%q has host bits set: use %s", value, p.Masked())
		}
		if v.Minimum != nil && int64(p.Bits()) < v.GetMinimum() {
			return fmt.Sprintf("%s has prefix length /%d, shorter than the minimum /%d", p, p.Bits(), v.GetMinimum())
		}
		if v.Maximum != nil && int64(p.Bits()) > v.GetMaximum() {
			return fmt.Sprintf("%s has prefix length /%d, longer than the maximum /%d", p, p.Bits(), v.GetMaximum())
		}
	default:
		return fmt.Sprintf("variable type %q is not one of %s", v.GetType(), strings.Join(Types, ", "))
	}
	return ""
}

// Problem is one variable value that does not resolve.
type Problem struct {
	// Name is the variable's name.
	Name    string
	Message string
}

func (p Problem) String() string { return p.Name + ": " + p.Message }

// Resolve returns the value of every variable of decl for a cluster that
// sets values: its own value, else the default. It reports values that
// fail their declaration, required variables with neither, and values
// for variables decl does not declare, in name order.
func Resolve(decl []*typesv1.ClusterClassVariable, values map[string]string) (map[string]string, []Problem) {
	out := make(map[string]string, len(decl))
	var probs []Problem
	declared := map[string]bool{}
	for _, v := range decl {
		declared[v.GetName()] = true
		val, ok := values[v.GetName()]
		if !ok {
			val = v.GetDefault()
			if val == "" {
				if v.GetRequired() {
					probs = append(probs, Problem{v.GetName(), "required: the class declares no default, so the cluster must set it"})
				}
				out[v.GetName()] = ""
				continue
			}
		}
		if msg := CheckValue(v, val); msg != "" {
			probs = append(probs, Problem{v.GetName(), msg})
		}
		out[v.GetName()] = val
	}
	for name := range values {
		if !declared[name] {
			probs = append(probs, Problem{name, "the class declares no such variable"})
		}
	}
	sort.Slice(probs, func(i, j int) bool { return probs[i].Name < probs[j].Name })
	return out, probs
}

// Ref is one reference to a variable in a string field.
type Ref struct {
	// Field is the field's path under the message walked, in YAML
	// spelling ("template.hostSelector[rack]", "podCidr").
	Field string
	// Name is the variable named; "" for a malformed reference, whose
	// problem is in Err.
	Name string
	Err  string
}

// References returns every reference in the string fields and string map
// values of m, in field order.
func References(m proto.Message) []Ref {
	var refs []Ref
	walk(m.ProtoReflect(), "", func(field, s string) string {
		for _, r := range parse(s) {
			r.Field = field
			refs = append(refs, r)
		}
		return s
	})
	return refs
}

// Substitute returns a copy of m whose string fields and string map values
// have their references replaced by values. A reference to a name values
// lacks is an error (validation refuses such a class).
func Substitute[M proto.Message](m M, values map[string]string) (M, error) {
	out := proto.Clone(m).(M)
	var err error
	walk(out.ProtoReflect(), "", func(field, s string) string {
		if err != nil || !strings.Contains(s, "$") {
			return s
		}
		r, e := expand(s, values)
		if e != nil {
			err = fmt.Errorf("%s: %w", field, e)
			return s
		}
		return r
	})
	return out, err
}

// walk calls fn on every set string field and string map value under m,
// replacing the value with fn's result when it differs. It visits fields
// in their declared order and map entries in key order (protoreflect's
// Range order is deliberately unstable), so references and errors come
// out the same every time.
func walk(m protoreflect.Message, prefix string, fn func(field, s string) string) {
	fields := m.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if !m.Has(fd) {
			continue
		}
		v := m.Get(fd)
		name := prefix + fd.JSONName()
		switch {
		case fd.IsMap():
			if fd.MapValue().Kind() != protoreflect.StringKind {
				continue
			}
			mp := v.Map()
			var keys []protoreflect.MapKey
			mp.Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
				keys = append(keys, k)
				return true
			})
			sort.Slice(keys, func(a, b int) bool { return keys[a].String() < keys[b].String() })
			for _, k := range keys {
				s := mp.Get(k).String()
				if r := fn(name+"["+k.String()+"]", s); r != s {
					mp.Set(k, protoreflect.ValueOfString(r))
				}
			}
		case fd.IsList():
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				f := fmt.Sprintf("%s[%d]", name, i)
				switch fd.Kind() {
				case protoreflect.StringKind:
					s := l.Get(i).String()
					if r := fn(f, s); r != s {
						l.Set(i, protoreflect.ValueOfString(r))
					}
				case protoreflect.MessageKind:
					walk(l.Get(i).Message(), f+".", fn)
				}
			}
		case fd.Kind() == protoreflect.StringKind:
			s := v.String()
			if r := fn(name, s); r != s {
				m.Set(fd, protoreflect.ValueOfString(r))
			}
		case fd.Kind() == protoreflect.MessageKind:
			walk(v.Message(), name+".", fn)
		}
	}
}

// parse finds the references in s.
func parse(s string) []Ref {
	var refs []Ref
	for i := 0; i < len(s); i++ {
		if s[i] != '$' {
			continue
		}
		if i+1 < len(s) && s[i+1] == '$' {
			i++
			continue
		}
		if i+1 >= len(s) || s[i+1] != '{' {
			refs = append(refs, Ref{Err: fmt.Sprintf("%q: a lone $ at offset %d: write ${name} for a variable or $$ for a dollar sign", s, i)})
			continue
		}
		end := strings.IndexByte(s[i:], '}')
		if end < 0 {
			refs = append(refs, Ref{Err: fmt.Sprintf("%q: ${ without a closing }", s)})
			break
		}
		name := strings.TrimSpace(s[i+2 : i+end])
		if !validName(name) {
			refs = append(refs, Ref{Err: fmt.Sprintf("%q: ${%s} is not a variable name (a letter, then letters, digits, _ or -)", s, name)})
		} else {
			refs = append(refs, Ref{Name: name})
		}
		i += end
	}
	return refs
}

// expand replaces the references of s.
func expand(s string, values map[string]string) (string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '$' {
			b.WriteByte(c)
			continue
		}
		if i+1 < len(s) && s[i+1] == '$' {
			b.WriteByte('$')
			i++
			continue
		}
		end := -1
		if i+1 < len(s) && s[i+1] == '{' {
			end = strings.IndexByte(s[i:], '}')
		}
		if end < 0 {
			return "", fmt.Errorf("%q: malformed reference at offset %d", s, i)
		}
		name := strings.TrimSpace(s[i+2 : i+end])
		v, ok := values[name]
		if !ok {
			return "", fmt.Errorf("%q: variable %q is not declared", s, name)
		}
		b.WriteString(v)
		i += end
	}
	return b.String(), nil
}

// ValidName reports whether name may name a variable.
func ValidName(name string) bool { return validName(name) }

func validName(name string) bool {
	if name == "" || len(name) > 63 {
		return false
	}
	for i, r := range name {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z':
		case i > 0 && (r >= '0' && r <= '9' || r == '_' || r == '-'):
		default:
			return false
		}
	}
	return true
}
