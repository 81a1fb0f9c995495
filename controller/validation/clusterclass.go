package validation

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/classvar"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// checkClusterClass checks a ClusterClass spec on its own: a control-plane
// class, uniquely named worker classes, well-formed templates, typed
// variables whose defaults, enums and bounds agree, and references
// (${name}, see controller/classvar) that name declared variables.
func checkClusterClass(p *problems, s *typesv1.ClusterClassSpec) {
	if s.GetControlPlane() == nil {
		p.add("spec.controlPlane", "required: the control-plane class (hostSelector, image or imageSelector, healthCheck)")
	} else {
		checkMachinesTemplate(p, "spec.controlPlane", s.GetControlPlane(), true)
	}
	seen := map[string]bool{}
	for i, w := range s.GetWorkers() {
		f := fmt.Sprintf("spec.workers[%d]", i)
		switch n := w.GetName(); {
		case n == "":
			p.add(f+".name", "required: the worker class's name, which pools of spec.topology.workers name")
		case dnsLabel(n) != "":
			p.add(f+".name", "%q %s", n, dnsLabel(n))
		case seen[n]:
			p.add(f+".name", "%q is used by another worker class: worker class names must be unique", n)
		}
		seen[w.GetName()] = true
		checkMachinesTemplate(p, f+".template", w.GetTemplate(), false)
	}
	declared := checkVariables(p, s.GetVariables())
	if c := s.GetCluster(); c != nil {
		if c.GetKubernetesVersion() != "" {
			p.add("spec.cluster.kubernetesVersion", "is set by each cluster's spec.topology.version: remove it from the class")
		}
		if c.GetTopology() != nil {
			p.add("spec.cluster.topology", "a class cannot hold a topology: remove it")
		}
		if !strings.Contains(c.GetPodCidr(), "$") {
			checkCIDR(p, "spec.cluster.podCidr", c.GetPodCidr(), false)
		}
		if !strings.Contains(c.GetServiceCidr(), "$") {
			checkCIDR(p, "spec.cluster.serviceCidr", c.GetServiceCidr(), false)
		}
	}
	// References: in the templates, not in the variables themselves or
	// the rollout.
	refs := func(prefix string, m proto.Message) {
		if m == nil || !m.ProtoReflect().IsValid() {
			return
		}
		for _, r := range classvar.References(m) {
			switch {
			case r.Err != "":
				p.add(prefix+r.Field, "%s", r.Err)
			case !declared[r.Name]:
				p.add(prefix+r.Field, "${%s} names no variable of spec.variables: declare it (name, type, default) or fix the name", r.Name)
			}
		}
	}
	refs("spec.controlPlane.", s.GetControlPlane())
	for i, w := range s.GetWorkers() {
		refs(fmt.Sprintf("spec.workers[%d].template.", i), w.GetTemplate())
	}
	refs("spec.cluster.", s.GetCluster())
	if ch := s.GetRollout().GetChange(); ch != nil && proto.Size(ch) > 0 {
		p.add("spec.rollout.change", "is filled in by the controller for each new revision (clusterClass and classRevision): remove it")
	}
}

// checkVariables checks the declarations and returns the declared names.
func checkVariables(p *problems, vars []*typesv1.ClusterClassVariable) map[string]bool {
	declared := map[string]bool{}
	for i, v := range vars {
		f := fmt.Sprintf("spec.variables[%d]", i)
		switch n := v.GetName(); {
		case n == "":
			p.add(f+".name", "required: the name clusters set in spec.topology.variables and templates use as ${name}")
		case !classvar.ValidName(n):
			p.add(f+".name", "%q is not a variable name: a letter, then letters, digits, '_' or '-' (at most 63)", n)
		case declared[n]:
			p.add(f+".name", "%q is declared twice: variable names must be unique", n)
		}
		declared[v.GetName()] = true
		if !slices.Contains(classvar.Types, v.GetType()) {
			if v.GetType() == "" {
				p.add(f+".type", "required: use %s", strings.Join(classvar.Types, ", "))
			} else {
				p.add(f+".type", "%q is not a variable type: use %s", v.GetType(), strings.Join(classvar.Types, ", "))
			}
			continue
		}
		if v.GetType() == classvar.TypeEnum {
			if len(v.GetEnum()) == 0 {
				p.add(f+".enum", "required for type enum: the allowed values")
			}
			if v.Minimum != nil || v.Maximum != nil {
				p.add(f, "minimum and maximum do not apply to type enum: remove them")
			}
			dup := map[string]bool{}
			for _, e := range v.GetEnum() {
				if dup[e] {
					p.add(f+".enum", "%q is listed twice", e)
				}
				dup[e] = true
			}
		} else if len(v.GetEnum()) > 0 {
			p.add(f+".enum", "is for type enum only: remove it, or set type enum")
		}
		if v.Minimum != nil && v.Maximum != nil && v.GetMinimum() > v.GetMaximum() {
			p.add(f, "minimum %d is above maximum %d", v.GetMinimum(), v.GetMaximum())
		}
		if v.GetType() == classvar.TypeCIDR {
			for _, b := range []*int64{v.Minimum, v.Maximum} {
				if b != nil && (*b < 0 || *b > 128) {
					p.add(f, "a cidr's minimum and maximum bound its prefix length: use 0 to 128, not %d", *b)
				}
			}
		}
		if d := v.GetDefault(); d != "" {
			if msg := classvar.CheckValue(v, d); msg != "" {
				p.add(f+".default", "%s", msg)
			}
		}
	}
	return declared
}

// checkMachinesTemplate checks a control-plane or worker template with the
// rules of a ControlPlane or MachineDeployment, skipping the values that
// name variables (they are checked once substituted, on the derived
// objects).
func checkMachinesTemplate(p *problems, prefix string, m *typesv1.ClusterClassMachines, controlPlane bool) {
	if m == nil {
		return
	}
	lit := func(s string) string {
		if strings.Contains(s, "$") {
			return ""
		}
		return s
	}
	litMap := func(in map[string]string) map[string]string {
		out := maps.Clone(in)
		maps.DeleteFunc(out, func(k, v string) bool { return strings.Contains(k+v, "$") })
		return out
	}
	var sub problems
	checkImageRef(&sub, lit(m.GetImage()))
	checkImageSelector(&sub, lit(m.GetImage()), litMap(m.GetImageSelector()))
	checkLabels(&sub, "spec.hostSelector", litMap(m.GetHostSelector()))
	if controlPlane {
		if m.GetStrategy() != nil {
			sub.add("spec.strategy", "is for worker classes: a control plane rolls with rolloutMaxSurge")
		}
		if s := m.GetRolloutMaxSurge(); s != 0 && s != 1 {
			sub.add("spec.rolloutMaxSurge", "%d is not supported: use 1 to roll out onto a spare host first (3→4→3) or 0 to reimage in place", s)
		}
	} else {
		if m.GetRolloutMaxSurge() != 0 {
			sub.add("spec.rolloutMaxSurge", "is for the control-plane class: a worker class rolls with strategy")
		}
		if st := m.GetStrategy(); st != nil {
			var md problems
			checkMachineDeployment(&md, &typesv1.MachineDeploymentSpec{Cluster: "x", Strategy: &typesv1.RolloutStrategy{
				Type: lit(st.GetType()), MaxSurge: lit(st.GetMaxSurge()), MaxUnavailable: lit(st.GetMaxUnavailable()), NodeDrainTimeout: lit(st.GetNodeDrainTimeout()),
			}})
			sub = append(sub, md...)
		}
	}
	if hc := m.GetHealthCheck(); hc != nil {
		if len(hc.GetSelector()) > 0 || hc.GetCluster() != "" {
			sub.add("spec.healthCheck", "cluster and selector are filled in by the controller: remove them")
		}
		c := proto.Clone(hc).(*typesv1.HealthCheckSpec)
		c.Cluster, c.Selector = "x", nil
		c.NodeStartupTimeout, c.MaxUnhealthy = lit(c.GetNodeStartupTimeout()), lit(c.GetMaxUnhealthy())
		for _, u := range c.GetUnhealthyConditions() {
			if strings.Contains(u.GetTimeout(), "$") {
				u.Timeout = "1m"
			}
		}
		var h problems
		checkHealthCheck(&h, c)
		for _, e := range h {
			sub = append(sub, FieldError{Field: "spec.healthCheck." + strings.TrimPrefix(e.Field, "spec."), Message: e.Message})
		}
	}
	for _, e := range sub {
		p.add(prefix+"."+strings.TrimPrefix(e.Field, "spec."), "%s", e.Message)
	}
}

// checkTopology checks a Cluster's spec.topology on its own; whether its
// class, worker classes and variables exist is checked against the
// stored class (ValidateAgainst).
func checkTopology(p *problems, s *typesv1.ClusterSpec) {
	t := s.GetTopology()
	if s.GetKubernetesVersion() != "" {
		p.add("spec.kubernetesVersion", "is set by spec.topology.version on a cluster with a topology: remove it")
	}
	if t.GetClass() == "" {
		p.add("spec.topology.class", "required: the name of a ClusterClass")
	} else if msg := dnsSubdomain(t.GetClass()); msg != "" {
		p.add("spec.topology.class", "%q %s", t.GetClass(), msg)
	}
	if t.GetVersion() == "" {
		p.add("spec.topology.version", "required: a pinned version such as v1.34.4")
	} else if _, err := ParseVersion(t.GetVersion()); err != nil {
		p.add("spec.topology.version", "%v", err)
	}
	switch r := t.GetControlPlaneReplicas(); {
	case r < 0:
		p.add("spec.topology.controlPlaneReplicas", "%d is negative: use 1, 3 or 5 (0 means 1)", r)
	case r > 0 && r%2 == 0:
		p.add("spec.topology.controlPlaneReplicas", "%d is even: an even number of control-plane members cannot keep etcd quorum better than one less: use 1, 3 or 5", r)
	}
	seen := map[string]bool{}
	for i, w := range t.GetWorkers() {
		f := fmt.Sprintf("spec.topology.workers[%d]", i)
		switch n := w.GetName(); {
		case n == "":
			p.add(f+".name", "required: the pool's name (its MachineDeployment is CLUSTER-NAME)")
		case dnsLabel(n) != "":
			p.add(f+".name", "%q %s", n, dnsLabel(n))
		case n == "control-plane":
			p.add(f+".name", "%q is the name of the cluster's control plane: pick another", n)
		case seen[n]:
			p.add(f+".name", "%q is used by another pool: pool names must be unique", n)
		}
		seen[w.GetName()] = true
		if w.GetClass() == "" {
			p.add(f+".class", "required: the name of one of the class's worker classes")
		}
		if w.GetReplicas() < 0 {
			p.add(f+".replicas", "%d is negative: use 0 or more", w.GetReplicas())
		}
	}
	for name := range t.GetVariables() {
		if !classvar.ValidName(name) {
			p.add("spec.topology.variables", "%q is not a variable name", name)
		}
	}
}

// checkTopologyAgainst checks a topology cluster against its class: the
// class exists, its pools name worker classes of the revision the cluster
// follows (o.ClassSpec), its variables resolve, its version skips no minor,
// its class does not change, and a pod CIDR is set once the class's
// defaults are applied.
func checkTopologyAgainst(p *problems, c *typesv1.Cluster, o Observed) {
	t := c.GetSpec().GetTopology()
	cur := o.Current.GetCluster().GetSpec().GetTopology()
	if o.Current.GetCluster() != nil && cur == nil {
		p.add("spec.topology", "cannot be added to an existing cluster: its ControlPlane and MachineDeployments are its own; create a new Cluster from the class")
		return
	}
	if cur != nil && cur.GetClass() != t.GetClass() {
		p.add("spec.topology.class", "cannot change from %q to %q: a cluster moves between revisions of its class (a Rollout), not between classes; create a new Cluster instead", cur.GetClass(), t.GetClass())
		return
	}
	if cur != nil {
		checkVersionChange(p, "spec.topology.version", cur.GetVersion(), t.GetVersion())
	}
	if o.Class == nil {
		p.add("spec.topology.class", "ClusterClass %q does not exist: apply it first (kilnctl get clusterclasses)", t.GetClass())
		return
	}
	if c.GetSpec().GetPodCidr() == "" {
		p.add("spec.podCidr", "required: neither the cluster nor ClusterClass %q (spec.cluster.podCidr) sets it", t.GetClass())
	}
	for _, msg := range topologyBreaks(c, o.ClassSpec, o.ImageVersions) {
		p.add(msg.field, "%s", msg.msg)
	}
}

type breakage struct{ field, msg string }

// topologyBreaks lists what keeps cluster c from being derived from class
// spec s: values that fail the variables, pools naming absent worker
// classes, images named by the templates that hold another Kubernetes
// version than the cluster's (images maps names to their versions).
func topologyBreaks(c *typesv1.Cluster, s *typesv1.ClusterClassSpec, images map[string]string) []breakage {
	t := c.GetSpec().GetTopology()
	var out []breakage
	vals, probs := classvar.Resolve(s.GetVariables(), t.GetVariables())
	for _, pr := range probs {
		out = append(out, breakage{"spec.topology.variables." + pr.Name, pr.Message})
	}
	workers := map[string]*typesv1.ClusterClassMachines{}
	var names []string
	for _, w := range s.GetWorkers() {
		workers[w.GetName()] = w.GetTemplate()
		names = append(names, w.GetName())
	}
	templates := []struct {
		what string
		m    *typesv1.ClusterClassMachines
	}{{"the control plane", s.GetControlPlane()}}
	for i, w := range t.GetWorkers() {
		m, ok := workers[w.GetClass()]
		if !ok {
			out = append(out, breakage{fmt.Sprintf("spec.topology.workers[%d].class", i),
				fmt.Sprintf("pool %s names worker class %q, which the class does not have (it has %s)", w.GetName(), w.GetClass(), strings.Join(names, ", "))})
			continue
		}
		templates = append(templates, struct {
			what string
			m    *typesv1.ClusterClassMachines
		}{"pool " + w.GetName(), m})
	}
	if len(probs) > 0 || len(images) == 0 {
		return out
	}
	want, err := ParseVersion(t.GetVersion())
	if err != nil {
		return out
	}
	for _, tm := range templates {
		if tm.m == nil {
			continue
		}
		m, err := classvar.Substitute(tm.m, vals)
		if err != nil {
			continue
		}
		iv, ok := images[m.GetImage()]
		if !ok || iv == "" {
			continue
		}
		got, err := ParseVersion(iv)
		if err != nil || got == want {
			continue
		}
		msg := fmt.Sprintf("image %s of %s holds Kubernetes %s but the cluster runs %s", m.GetImage(), tm.what, got, want)
		if got.Major == want.Major && got.Minor > want.Minor+1 {
			msg += fmt.Sprintf(": that skips %s; a cluster upgrades one minor at a time", Version{Major: want.Major, Minor: want.Minor + 1}.MinorString())
		}
		out = append(out, breakage{"spec.topology.version", msg})
	}
	return out
}

// checkClassAgainst refuses a ClusterClass change that would break one of
// its clusters (o.ClassClusters): a variable value no longer valid, a
// worker class removed that a pool uses, an image of another Kubernetes
// version. The message lists every cluster it would break.
func checkClassAgainst(p *problems, cc *typesv1.ClusterClass, o Observed) {
	var broken []string
	for _, c := range o.ClassClusters {
		bs := topologyBreaks(c, cc.GetSpec(), o.ImageVersions)
		if len(bs) == 0 {
			continue
		}
		msgs := make([]string, len(bs))
		for i, b := range bs {
			msgs[i] = strings.TrimPrefix(b.field, "spec.topology.") + ": " + b.msg
		}
		broken = append(broken, fmt.Sprintf("%s (%s)", c.GetMetadata().GetName(), strings.Join(msgs, "; ")))
	}
	if len(broken) > 0 {
		p.add("spec", "the change would break %d cluster(s) of the class: %s; change those clusters' spec.topology first, or keep the class compatible",
			len(broken), strings.Join(broken, ", "))
	}
}
