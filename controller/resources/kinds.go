package resources

import (
	"sort"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// APIVersion is the apiVersion of every stored resource.
const APIVersion = "kiln.dev/v1"

// Kind describes one resource kind.
type Kind struct {
	// Name is the kind as written in YAML ("Host").
	Name string
	// Plural is the store key kind ("hosts").
	Plural string
	// New returns an empty object of the kind.
	New  func() proto.Message
	wrap func(proto.Message) *controllerv1.Resource
}

// Wrap puts obj, which must be of kind k, into a Resource.
func (k Kind) Wrap(obj proto.Message) *controllerv1.Resource { return k.wrap(obj) }

// Kinds is every resource kind, in the order they are documented.
var Kinds = []Kind{
	{"Host", "hosts", func() proto.Message { return &typesv1.Host{} },
		func(m proto.Message) *controllerv1.Resource {
			return &controllerv1.Resource{Kind: &controllerv1.Resource_Host{Host: m.(*typesv1.Host)}}
		}},
	{"Image", "images", func() proto.Message { return &typesv1.Image{} },
		func(m proto.Message) *controllerv1.Resource {
			return &controllerv1.Resource{Kind: &controllerv1.Resource_Image{Image: m.(*typesv1.Image)}}
		}},
	{"Cluster", "clusters", func() proto.Message { return &typesv1.Cluster{} },
		func(m proto.Message) *controllerv1.Resource {
			return &controllerv1.Resource{Kind: &controllerv1.Resource_Cluster{Cluster: m.(*typesv1.Cluster)}}
		}},
	{"ControlPlane", "controlplanes", func() proto.Message { return &typesv1.ControlPlane{} },
		func(m proto.Message) *controllerv1.Resource {
			return &controllerv1.Resource{Kind: &controllerv1.Resource_ControlPlane{ControlPlane: m.(*typesv1.ControlPlane)}}
		}},
	{"MachineDeployment", "machinedeployments", func() proto.Message { return &typesv1.MachineDeployment{} },
		func(m proto.Message) *controllerv1.Resource {
			return &controllerv1.Resource{Kind: &controllerv1.Resource_MachineDeployment{MachineDeployment: m.(*typesv1.MachineDeployment)}}
		}},
	{"Machine", "machines", func() proto.Message { return &typesv1.Machine{} },
		func(m proto.Message) *controllerv1.Resource {
			return &controllerv1.Resource{Kind: &controllerv1.Resource_Machine{Machine: m.(*typesv1.Machine)}}
		}},
	{"HealthCheck", "healthchecks", func() proto.Message { return &typesv1.HealthCheck{} },
		func(m proto.Message) *controllerv1.Resource {
			return &controllerv1.Resource{Kind: &controllerv1.Resource_HealthCheck{HealthCheck: m.(*typesv1.HealthCheck)}}
		}},
	{"ClusterClass", "clusterclasses", func() proto.Message { return &typesv1.ClusterClass{} },
		func(m proto.Message) *controllerv1.Resource {
			return &controllerv1.Resource{Kind: &controllerv1.Resource_ClusterClass{ClusterClass: m.(*typesv1.ClusterClass)}}
		}},
	{"Rollout", "rollouts", func() proto.Message { return &typesv1.Rollout{} },
		func(m proto.Message) *controllerv1.Resource {
			return &controllerv1.Resource{Kind: &controllerv1.Resource_Rollout{Rollout: m.(*typesv1.Rollout)}}
		}},
	{"GitSource", "gitsources", func() proto.Message { return &typesv1.GitSource{} },
		func(m proto.Message) *controllerv1.Resource {
			return &controllerv1.Resource{Kind: &controllerv1.Resource_GitSource{GitSource: m.(*typesv1.GitSource)}}
		}},
}

// LookupKind finds a kind by its name, plural or singular in any case
// ("Host", "hosts", "host", "HOSTS"). Unknown kinds are InvalidArgument.
func LookupKind(s string) (Kind, error) {
	l := strings.ToLower(s)
	for _, k := range Kinds {
		if l == strings.ToLower(k.Name) || l == k.Plural {
			return k, nil
		}
	}
	names := make([]string, 0, len(Kinds))
	for _, k := range Kinds {
		names = append(names, k.Plural)
	}
	sort.Strings(names)
	return Kind{}, errdefs.InvalidArgument("unknown kind %q: want one of %s", s, strings.Join(names, ", "))
}

// Unwrap returns the kind and the object held by r. An empty Resource is
// InvalidArgument.
func Unwrap(r *controllerv1.Resource) (Kind, proto.Message, error) {
	var m proto.Message
	switch o := r.GetKind().(type) {
	case *controllerv1.Resource_Host:
		m = o.Host
	case *controllerv1.Resource_Image:
		m = o.Image
	case *controllerv1.Resource_Cluster:
		m = o.Cluster
	case *controllerv1.Resource_ControlPlane:
		m = o.ControlPlane
	case *controllerv1.Resource_MachineDeployment:
		m = o.MachineDeployment
	case *controllerv1.Resource_Machine:
		m = o.Machine
	case *controllerv1.Resource_HealthCheck:
		m = o.HealthCheck
	case *controllerv1.Resource_ClusterClass:
		m = o.ClusterClass
	case *controllerv1.Resource_Rollout:
		m = o.Rollout
	case *controllerv1.Resource_GitSource:
		m = o.GitSource
	}
	if m == nil || !m.ProtoReflect().IsValid() {
		return Kind{}, nil, errdefs.InvalidArgument("resource holds no object: set one of Host, Image, Cluster, ControlPlane, MachineDeployment, Machine, HealthCheck, ClusterClass, Rollout, GitSource")
	}
	name := string(m.ProtoReflect().Descriptor().Name())
	for _, k := range Kinds {
		if k.Name == name {
			return k, m, nil
		}
	}
	return Kind{}, nil, errdefs.InvalidArgument("unknown kind %q", name)
}

// Every kind has the fields api_version, kind, metadata, spec and status;
// these helpers reach them without a switch per kind.

func field(m proto.Message, name string) protoreflect.FieldDescriptor {
	return m.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(name))
}

// Meta returns obj's metadata, creating it when absent.
func Meta(obj proto.Message) *typesv1.ObjectMeta {
	return obj.ProtoReflect().Mutable(field(obj, "metadata")).Message().Interface().(*typesv1.ObjectMeta)
}

// Spec returns obj's spec message (possibly invalid/empty when unset).
func Spec(obj proto.Message) protoreflect.Message {
	return obj.ProtoReflect().Get(field(obj, "spec")).Message()
}

// setSpec copies the spec of src into dst (same kind).
func setSpec(dst, src proto.Message) {
	f := field(dst, "spec")
	if !src.ProtoReflect().Has(f) {
		dst.ProtoReflect().Clear(f)
		return
	}
	dst.ProtoReflect().Set(f, protoreflect.ValueOfMessage(proto.Clone(src.ProtoReflect().Get(f).Message().Interface()).ProtoReflect()))
}

// Status returns obj's status message.
func Status(obj proto.Message) protoreflect.Message {
	return obj.ProtoReflect().Get(field(obj, "status")).Message()
}

// clearStatus drops obj's status: status is owned by the controller.
func clearStatus(obj proto.Message) {
	obj.ProtoReflect().Clear(field(obj, "status"))
}

// setHeader sets apiVersion and kind.
func setHeader(obj proto.Message, k Kind) {
	r := obj.ProtoReflect()
	r.Set(field(obj, "api_version"), protoreflect.ValueOfString(APIVersion))
	r.Set(field(obj, "kind"), protoreflect.ValueOfString(k.Name))
}

// specEqual reports whether a and b have equal specs.
func specEqual(a, b proto.Message) bool {
	return proto.Equal(Spec(a).Interface(), Spec(b).Interface())
}
