package validation

import (
	"fmt"

	"google.golang.org/protobuf/reflect/protoreflect"

	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Size bounds of every field an apply stores (metadata and spec): a
// string or bytes value, and the items of a list or map. No field of any
// kind needs more, and without a bound five hosts with a 1 MB
// rootDiskHint made `kilnctl get hosts` fail for everyone (a list answer
// is bounded by the 4 MiB gRPC message limit).
const (
	MaxFieldBytes = 4096
	MaxFieldItems = 1024
)

// checkSizes reports every value of r's metadata and spec over the
// bounds. It runs before the other checks, which may quote values.
func checkSizes(p *problems, r *controllerv1.Resource) {
	oneof := r.ProtoReflect().Descriptor().Oneofs().ByName("kind")
	fd := r.ProtoReflect().WhichOneof(oneof)
	if fd == nil {
		return
	}
	obj := r.ProtoReflect().Get(fd).Message()
	for _, name := range []protoreflect.Name{"metadata", "spec"} {
		f := obj.Descriptor().Fields().ByName(name)
		if f == nil || !obj.Has(f) {
			continue
		}
		sizes(p, f.JSONName(), obj.Get(f).Message(), 0)
	}
}

func sizes(p *problems, path string, m protoreflect.Message, depth int) {
	if depth > 32 {
		p.add(path, "nested more than 32 levels deep")
		return
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		f := path + "." + fd.JSONName()
		switch {
		case fd.IsList():
			l := v.List()
			if l.Len() > MaxFieldItems {
				p.add(f, "has %d items: at most %d", l.Len(), MaxFieldItems)
				return true
			}
			for i := 0; i < l.Len(); i++ {
				sizeOf(p, fmt.Sprintf("%s[%d]", f, i), fd, l.Get(i), depth)
			}
		case fd.IsMap():
			mp := v.Map()
			if mp.Len() > MaxFieldItems {
				p.add(f, "has %d entries: at most %d", mp.Len(), MaxFieldItems)
				return true
			}
			mp.Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				key := k.String()
				if len(key) > MaxFieldBytes {
					p.add(f, "has a key of %d bytes: at most %d", len(key), MaxFieldBytes)
					return true
				}
				sizeOf(p, f+"["+short(key)+"]", fd.MapValue(), mv, depth)
				return true
			})
		default:
			sizeOf(p, f, fd, v, depth)
		}
		return true
	})
}

func sizeOf(p *problems, path string, fd protoreflect.FieldDescriptor, v protoreflect.Value, depth int) {
	switch fd.Kind() {
	case protoreflect.StringKind:
		if n := len(v.String()); n > MaxFieldBytes {
			p.add(path, "is %d bytes long: at most %d", n, MaxFieldBytes)
		}
	case protoreflect.BytesKind:
		if n := len(v.Bytes()); n > MaxFieldBytes {
			p.add(path, "is %d bytes long: at most %d", n, MaxFieldBytes)
		}
	case protoreflect.MessageKind, protoreflect.GroupKind:
		sizes(p, path, v.Message(), depth+1)
	}
}

// short cuts a map key quoted in a field path.
func short(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
