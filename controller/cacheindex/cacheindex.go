// Package cacheindex names the indexes of the controller's watch caches
// (store.Cache) and adds them to a cache of any resource kind, by the
// fields its messages have: one definition for every cache that readers
// look up by index (the replica's resources.Caches, and the caches tests
// build for one executor).
package cacheindex

import (
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kilnhq/kiln/controller/store"
)

// Index names (store.Cache.ByIndex, IndexLen).
const (
	// Cluster finds objects by spec.cluster (control planes, machine
	// deployments, machines, health checks).
	Cluster = "cluster"
	// Owner finds machines by spec.owner ("ControlPlane/NAME",
	// "MachineDeployment/NAME").
	Owner = "owner"
	// Host finds machines by spec.host.
	Host = "host"
	// Machine finds hosts by status.machine.
	Machine = "machine"
	// State finds objects by the name of their status.state enum value
	// (hosts: "HOST_STATE_AVAILABLE", ...): the cluster executor's spare
	// hosts, counts of hosts by state.
	State = "state"
	// ConditionNotTrue finds objects by the types of their
	// status.conditions whose status is not "True" (hosts that say
	// LifecycleRunning=False). Conditions that hold are not indexed: most
	// objects are in no set.
	ConditionNotTrue = "condition-not-true"
)

// Add adds to c every index that objects like obj allow (their kind has
// the field). Call before c runs.
func Add(c *store.Cache, obj proto.Message) {
	for _, idx := range []struct{ name, msg, field string }{
		{Cluster, "spec", "cluster"},
		{Owner, "spec", "owner"},
		{Host, "spec", "host"},
		{Machine, "status", "machine"},
	} {
		if fn := stringField(obj, idx.msg, idx.field); fn != nil {
			c.AddIndex(idx.name, fn)
		}
	}
	if fn := enumField(obj, "status", "state"); fn != nil {
		c.AddIndex(State, fn)
	}
	if fn := conditionsNotTrue(obj); fn != nil {
		c.AddIndex(ConditionNotTrue, fn)
	}
}

// subField returns the descriptors of obj's message field sub and of its
// field name, or nils when obj has no such fields.
func subField(obj proto.Message, sub, name string) (protoreflect.FieldDescriptor, protoreflect.FieldDescriptor) {
	sf := obj.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(sub))
	if sf == nil || sf.Message() == nil || sf.IsList() || sf.IsMap() {
		return nil, nil
	}
	f := sf.Message().Fields().ByName(protoreflect.Name(name))
	if f == nil || f.IsList() || f.IsMap() {
		return nil, nil
	}
	return sf, f
}

// stringField is an index of the string field sub.name, or nil when
// objects like obj have no such field.
func stringField(obj proto.Message, sub, name string) store.IndexFunc {
	sf, f := subField(obj, sub, name)
	if f == nil || f.Kind() != protoreflect.StringKind {
		return nil
	}
	return func(it store.Item) []string {
		if v := it.Msg.ProtoReflect().Get(sf).Message().Get(f).String(); v != "" {
			return []string{v}
		}
		return nil
	}
}

// enumField is an index of the enum field sub.name by its value's name,
// or nil when objects like obj have no such field.
func enumField(obj proto.Message, sub, name string) store.IndexFunc {
	sf, f := subField(obj, sub, name)
	if f == nil || f.Kind() != protoreflect.EnumKind {
		return nil
	}
	values := f.Enum().Values()
	return func(it store.Item) []string {
		n := it.Msg.ProtoReflect().Get(sf).Message().Get(f).Enum()
		if v := values.ByNumber(n); v != nil {
			return []string{string(v.Name())}
		}
		return nil
	}
}

// conditionsNotTrue is the ConditionNotTrue index, or nil when objects
// like obj have no status.conditions of type and status strings.
func conditionsNotTrue(obj proto.Message) store.IndexFunc {
	sf := obj.ProtoReflect().Descriptor().Fields().ByName("status")
	if sf == nil || sf.Message() == nil {
		return nil
	}
	cf := sf.Message().Fields().ByName("conditions")
	if cf == nil || !cf.IsList() || cf.Message() == nil {
		return nil
	}
	typ, status := cf.Message().Fields().ByName("type"), cf.Message().Fields().ByName("status")
	if typ == nil || status == nil || typ.Kind() != protoreflect.StringKind || status.Kind() != protoreflect.StringKind {
		return nil
	}
	return func(it store.Item) []string {
		list := it.Msg.ProtoReflect().Get(sf).Message().Get(cf).List()
		var out []string
		for i := range list.Len() {
			c := list.Get(i).Message()
			if c.Get(status).String() != "True" {
				out = append(out, c.Get(typ).String())
			}
		}
		return out
	}
}
