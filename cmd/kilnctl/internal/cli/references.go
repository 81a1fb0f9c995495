package cli

import (
	"context"
	"fmt"
	"sort"
	"strings"

	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// fleet indexes the objects references may name, by kind: what the
// controller holds plus what is being applied.
type fleet struct {
	images   map[string]*typesv1.Image
	clusters map[string]bool
	hosts    map[string]*typesv1.Host
}

func newFleet() *fleet {
	return &fleet{images: map[string]*typesv1.Image{}, clusters: map[string]bool{}, hosts: map[string]*typesv1.Host{}}
}

func (f *fleet) add(r *controllerv1.Resource) {
	switch x := r.GetKind().(type) {
	case *controllerv1.Resource_Image:
		f.images[x.Image.GetMetadata().GetName()] = x.Image
	case *controllerv1.Resource_Cluster:
		f.clusters[x.Cluster.GetMetadata().GetName()] = true
	case *controllerv1.Resource_Host:
		f.hosts[x.Host.GetMetadata().GetName()] = x.Host
	}
}

// refKinds returns the kinds danglingRefs needs listed to check the
// references of applied ("Image", "Cluster", "Host").
func refKinds(applied []*controllerv1.Resource) []string {
	need := map[string]bool{}
	for _, r := range applied {
		switch r.GetKind().(type) {
		case *controllerv1.Resource_ControlPlane, *controllerv1.Resource_MachineDeployment:
			need["Image"], need["Cluster"], need["Host"] = true, true, true
		case *controllerv1.Resource_Machine:
			need["Image"], need["Cluster"], need["Host"] = true, true, true
		case *controllerv1.Resource_HealthCheck:
			need["Cluster"] = true
		}
	}
	var out []string
	for _, k := range []string{"Image", "Cluster", "Host"} {
		if need[k] {
			out = append(out, k)
		}
	}
	return out
}

// danglingRefs returns one warning per reference in applied that names
// nothing in f (which holds the stored objects and the applied ones): an
// image, a cluster or a host that does not exist, a host selector (or
// image selector) that matches none. Each names the command that shows
// what does exist. The controller accepts such references (the object
// may come later); these say why nothing would happen yet.
func danglingRefs(applied []*controllerv1.Resource, f *fleet) []string {
	var out []string
	for _, r := range applied {
		var spec interface {
			GetCluster() string
			GetImage() string
		}
		var hostSelector map[string]string
		placed := false // placed on hosts by hostSelector
		host := ""
		switch x := r.GetKind().(type) {
		case *controllerv1.Resource_ControlPlane:
			spec, hostSelector, placed = x.ControlPlane.GetSpec(), x.ControlPlane.GetSpec().GetHostSelector(), true
		case *controllerv1.Resource_MachineDeployment:
			spec, hostSelector, placed = x.MachineDeployment.GetSpec(), x.MachineDeployment.GetSpec().GetHostSelector(), true
		case *controllerv1.Resource_Machine:
			spec, host = x.Machine.GetSpec(), x.Machine.GetSpec().GetHost()
		case *controllerv1.Resource_HealthCheck:
			if c := x.HealthCheck.GetSpec().GetCluster(); c != "" && !f.clusters[c] {
				out = append(out, fmt.Sprintf("%s: spec.cluster %s does not exist (%s)", objRef(r), c, lists("clusters", keys(f.clusters))))
			}
			continue
		default:
			continue
		}
		who := objRef(r)
		if c := spec.GetCluster(); c != "" && !f.clusters[c] {
			out = append(out, fmt.Sprintf("%s: spec.cluster %s does not exist (%s)", who, c, lists("clusters", keys(f.clusters))))
		}
		if img := spec.GetImage(); img != "" && f.images[img] == nil {
			out = append(out, fmt.Sprintf("%s: spec.image %s does not exist (%s)", who, img, lists("images", keys(f.images))))
		}
		if sel := imageSelector(r); len(sel) > 0 && !f.anyImage(sel) {
			out = append(out, fmt.Sprintf("%s: spec.imageSelector %s matches no image (%s)", who, selectorString(sel), lists("images", keys(f.images))))
		}
		if host != "" && f.hosts[host] == nil {
			out = append(out, fmt.Sprintf("%s: spec.host %s does not exist (kilnctl get hosts lists %d)", who, host, len(f.hosts)))
		}
		switch {
		case !placed || f.anyHost(hostSelector):
		case len(hostSelector) == 0:
			out = append(out, fmt.Sprintf("%s: no host exists to place it on (kilnctl get hosts lists 0)", who))
		case len(f.hosts) == 0:
			out = append(out, fmt.Sprintf("%s: spec.hostSelector %s matches no host (kilnctl get hosts lists 0)", who, selectorString(hostSelector)))
		default:
			sel := selectorString(hostSelector)
			out = append(out, fmt.Sprintf("%s: spec.hostSelector %s matches no host (kilnctl get hosts -l %s lists none of %d)", who, sel, sel, len(f.hosts)))
		}
	}
	return out
}

// imageSelector is spec.imageSelector (a label selector over Images) of
// a ControlPlane or MachineDeployment.
func imageSelector(r *controllerv1.Resource) map[string]string {
	switch x := r.GetKind().(type) {
	case *controllerv1.Resource_ControlPlane:
		return x.ControlPlane.GetSpec().GetImageSelector()
	case *controllerv1.Resource_MachineDeployment:
		return x.MachineDeployment.GetSpec().GetImageSelector()
	}
	return nil
}

func (f *fleet) anyHost(sel map[string]string) bool {
	for _, h := range f.hosts {
		if labelsMatch(h.GetMetadata().GetLabels(), sel) {
			return true
		}
	}
	return false
}

func (f *fleet) anyImage(sel map[string]string) bool {
	for _, img := range f.images {
		if labelsMatch(img.GetMetadata().GetLabels(), sel) {
			return true
		}
	}
	return false
}

// labelsMatch is the controller's selector rule: every pair of sel is in
// labels; an empty selector matches everything.
func labelsMatch(labels, sel map[string]string) bool {
	for k, v := range sel {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// selectorString writes sel as kilnctl's -l takes it: "k=v,k2=v2".
func selectorString(sel map[string]string) string {
	parts := make([]string, 0, len(sel))
	for k, v := range sel {
		parts = append(parts, k+"="+v)
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}

func objRef(r *controllerv1.Resource) string {
	k, _ := lookupKind(kindName(r))
	return k.lower() + "/" + metaOf(r).GetName()
}

func kindName(r *controllerv1.Resource) string {
	od := r.ProtoReflect().Descriptor().Oneofs().ByName("kind")
	if fd := r.ProtoReflect().WhichOneof(od); fd != nil {
		return string(fd.Message().Name())
	}
	return ""
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// lists says what `kilnctl get KIND` would list: "kilnctl get images
// lists 2: a, b" (at most three names).
func lists(kind string, names []string) string {
	s := fmt.Sprintf("kilnctl get %s lists %d", kind, len(names))
	if len(names) == 0 {
		return s
	}
	if len(names) > 3 {
		return s + ": " + strings.Join(names[:3], ", ") + ", ..."
	}
	return s + ": " + strings.Join(names, ", ")
}

// warnDangling lists the kinds applied refers to and prints a warning
// per dangling reference on errOut, kubectl style ("Warning: ..."). It
// never fails the apply: when listing fails it says so in one warning.
func (a *app) warnDangling(ctx context.Context, c controllerv1.ResourcesClient, applied []*controllerv1.Resource, warn func(string)) {
	kinds := refKinds(applied)
	if len(kinds) == 0 {
		return
	}
	f := newFleet()
	for _, k := range kinds {
		items, err := a.listAll(ctx, c, k)
		if err != nil {
			warn(fmt.Sprintf("could not check the references of what was applied: %v", err))
			return
		}
		for _, it := range items {
			f.add(it)
		}
	}
	for _, r := range applied {
		f.add(r)
	}
	for _, w := range danglingRefs(applied, f) {
		warn(w)
	}
}
