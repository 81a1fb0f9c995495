package clusterplan

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// world is a simulated fleet the planners' actions are applied to, the
// way the executor and the host lifecycle would: a created machine's host
// goes Provisioning; settle makes every new machine a Ready node (and an
// etcd member for the control plane); a deleted machine's host is wiped
// and Available again.
type world struct {
	now      time.Time
	cluster  *typesv1.Cluster
	cp       *typesv1.ControlPlane
	mds      map[string]*typesv1.MachineDeployment
	hcs      map[string]*typesv1.HealthCheck
	machines map[string]*typesv1.Machine
	hosts    map[string]*typesv1.Host
	// images are the Images declared with addImage; while none is, every
	// image name the specs and machines use exists (imageList).
	images map[string]*typesv1.Image
}

func newWorld(now time.Time) *world {
	return &world{
		now:      now,
		cluster:  &typesv1.Cluster{Metadata: &typesv1.ObjectMeta{Name: "c1"}, Spec: &typesv1.ClusterSpec{}},
		mds:      map[string]*typesv1.MachineDeployment{},
		hcs:      map[string]*typesv1.HealthCheck{},
		machines: map[string]*typesv1.Machine{},
		hosts:    map[string]*typesv1.Host{},
		images:   map[string]*typesv1.Image{},
	}
}

func (w *world) addImage(name string, labels map[string]string, patch, version string) {
	w.images[name] = &typesv1.Image{
		Metadata: &typesv1.ObjectMeta{Name: name, Labels: labels},
		Spec:     &typesv1.ImageSpec{PatchLevel: patch, KubernetesVersion: version},
	}
}

// imageList is the declared images, or when none was declared an image
// for every name the control plane, the deployments and the machines use.
func (w *world) imageList() []*typesv1.Image {
	out := []*typesv1.Image{}
	if len(w.images) > 0 {
		for _, img := range w.images {
			out = append(out, img)
		}
	} else {
		seen := map[string]bool{"": true}
		add := func(n string) {
			if !seen[n] {
				seen[n] = true
				out = append(out, &typesv1.Image{Metadata: &typesv1.ObjectMeta{Name: n}, Spec: &typesv1.ImageSpec{}})
			}
		}
		add(w.cp.GetSpec().GetImage())
		for _, md := range w.mds {
			add(md.GetSpec().GetImage())
		}
		for _, m := range w.machines {
			add(m.GetSpec().GetImage())
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetMetadata().GetName() < out[j].GetMetadata().GetName() })
	return out
}

func (w *world) machineList() []*typesv1.Machine {
	out := make([]*typesv1.Machine, 0, len(w.machines))
	for _, m := range w.machines {
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetMetadata().GetName() < out[j].GetMetadata().GetName() })
	return out
}

func (w *world) hostList() []*typesv1.Host {
	out := make([]*typesv1.Host, 0, len(w.hosts))
	for _, h := range w.hosts {
		out = append(out, h)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetMetadata().GetName() < out[j].GetMetadata().GetName() })
	return out
}

func (w *world) addHost(name string, labels map[string]string) {
	w.hosts[name] = &typesv1.Host{
		Metadata: &typesv1.ObjectMeta{Name: name, Labels: labels},
		Status:   &typesv1.HostStatus{State: typesv1.HostState_HOST_STATE_AVAILABLE},
	}
}

// addMachine adds a machine that is already a Ready node on host.
func (w *world) addMachine(name, owner, role, host, version, image string) *typesv1.Machine {
	m := &typesv1.Machine{
		Metadata: &typesv1.ObjectMeta{Name: name, CreationTimestamp: timestamppb.New(w.now)},
		Spec:     &typesv1.MachineSpec{Cluster: "c1", Role: role, Host: host, Version: version, Image: image, Owner: owner},
		Status:   &typesv1.MachineStatus{},
	}
	w.machines[name] = m
	if h := w.hosts[host]; h != nil {
		h.Status.State = typesv1.HostState_HOST_STATE_PROVISIONING
		h.Status.Machine = name
	}
	return m
}

func (w *world) setCond(m *typesv1.Machine, t, status string) {
	m.Status.Conditions, _ = conditions.Set(m.Status.Conditions, conditions.New(t, status, "", ""), w.now)
}

// makeReady turns m into a Ready node (and a healthy etcd member for the
// control plane).
func (w *world) makeReady(m *typesv1.Machine) {
	m.Status.NodeName = m.Spec.Host
	w.setCond(m, MachineNodeReady, conditions.True)
	if m.Spec.Role == RoleControlPlane {
		m.Status.EtcdMember = m.Spec.Host
		w.setCond(m, MachineEtcdHealthy, conditions.True)
	}
	if h := w.hosts[m.Spec.Host]; h != nil {
		h.Status.State = typesv1.HostState_HOST_STATE_PROVISIONED
	}
}

// settle makes every machine without a node Ready.
func (w *world) settle() {
	for _, m := range w.machineList() {
		if m.Status.NodeName == "" {
			w.makeReady(m)
		}
	}
}

// apply runs actions the way the executor does.
func (w *world) apply(actions []Action) {
	for _, a := range actions {
		switch a := a.(type) {
		case CreateMachine:
			role := a.Role
			w.addMachine(a.Machine, a.Owner, role, a.Host, a.Version, a.Image)
		case Drain:
			if m := w.machines[a.Machine]; m != nil {
				w.setCond(m, MachineDrained, conditions.True)
			}
		case RemoveEtcdMember:
			if m := w.machines[a.Machine]; m != nil {
				m.Status.EtcdMember = ""
				var keep []*typesv1.Condition
				for _, c := range m.Status.Conditions {
					if c.Type != MachineEtcdHealthy {
						keep = append(keep, c)
					}
				}
				m.Status.Conditions = keep
			}
		case DeleteMachine:
			delete(w.machines, a.Machine)
			if h := w.hosts[a.Host]; h != nil {
				h.Status.State = typesv1.HostState_HOST_STATE_AVAILABLE
				h.Status.Machine = ""
			}
		default:
			panic(fmt.Sprintf("unknown action %T", a))
		}
	}
}

func (w *world) planCP() ControlPlanePlan {
	p := PlanControlPlane(ControlPlaneInput{Cluster: w.cluster, ControlPlane: w.cp, Machines: w.machineList(), Hosts: w.hostList(), Images: w.imageList()}, w.now)
	w.cp.Status = p.Status
	return p
}

func (w *world) planMD(name string) DeploymentPlan {
	md := w.mds[name]
	p := PlanMachineDeployment(DeploymentInput{Cluster: w.cluster, ControlPlane: w.cp, MachineDeployment: md, Machines: w.machineList(), Hosts: w.hostList(), Images: w.imageList()}, w.now)
	md.Status = p.Status
	return p
}

func (w *world) planHC(name string) HealthCheckPlan {
	hc := w.hcs[name]
	p := PlanHealthCheck(HealthCheckInput{HealthCheck: hc, Machines: w.machineList()}, w.now)
	hc.Status = p.Status
	return p
}

// availableWorkers counts the Ready, not draining, not deleting machines
// of owner.
func (w *world) availableWorkers(owner string) int {
	n := 0
	for _, m := range w.machines {
		if m.Spec.Owner == owner && (machine{m}).available() {
			n++
		}
	}
	return n
}

func formatActions(as []Action) string {
	var b strings.Builder
	for _, a := range as {
		fmt.Fprintf(&b, "action %s\n", a)
	}
	return b.String()
}

func formatConds(cs []*typesv1.Condition, t0 time.Time) string {
	var b strings.Builder
	for _, c := range cs {
		fmt.Fprintf(&b, "condition %s=%s reason=%s since=%s", c.Type, c.Status, c.Reason, c.LastTransitionTime.AsTime().Sub(t0))
		if c.Message != "" {
			fmt.Fprintf(&b, " %q", c.Message)
		}
		b.WriteString("\n")
	}
	return b.String()
}
