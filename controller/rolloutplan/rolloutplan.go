// Package rolloutplan decides how a Rollout carries its change (a
// Kubernetes version, an image, or a ClusterClass revision) to its
// clusters: wave by wave in the order of the wave label, at most
// maxConcurrent clusters of a wave at once, a bake time between waves,
// and halt rules (a cluster not done within readyTimeout, a HealthCheck
// remediation, a condition the user names). Decide is pure: no I/O, no
// clock; controller/rolloutexec gathers its input, stores its status and
// performs its actions.
//
// Crash safety: Decide records a cluster it starts in the status
// (status.clusters) and only plans moves for clusters the stored status
// already holds, so an executor that stores the status before it moves
// anything, and restarts anywhere, neither moves a cluster twice nor
// skips one.
package rolloutplan

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/validation"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Phases of a Rollout (status.phase).
const (
	PhasePending     = "Pending"
	PhaseProgressing = "Progressing"
	PhaseBaking      = "Baking"
	PhasePaused      = "Paused"
	PhaseHalted      = "Halted"
	PhaseAborted     = "Aborted"
	PhaseComplete    = "Complete"
)

// States of a wave (status.waves[].state).
const (
	WaveWaiting    = "Waiting"
	WaveInProgress = "InProgress"
	WaveBaking     = "Baking"
	WaveDone       = "Done"
	WaveHalted     = "Halted"
)

// States of a started cluster (status.clusters[].state).
const (
	ClusterInProgress = "InProgress"
	ClusterDone       = "Done"
)

// Conditions and their reasons. Progressing is False (blocking, shown by
// kilnctl get) while the rollout is halted, refused, paused or aborted,
// and its message counts the clusters done; Complete is True once every
// wave is done (absent before).
const (
	ConditionProgressing = "Progressing"
	ConditionComplete    = "Complete"

	ReasonRolling       = "Rolling"
	ReasonBaking        = "Baking"
	ReasonPaused        = "Paused"
	ReasonAborted       = "Aborted"
	ReasonNoClusters    = "NoClusters"
	ReasonComplete      = "Complete"
	ReasonIncomplete    = "Incomplete"
	ReasonReadyTimeout  = "ReadyTimeout"
	ReasonRemediation   = "Remediation"
	ReasonHaltCondition = "HaltCondition"
	// ReasonRefused: the change would break a cluster (a skipped minor,
	// a downgrade); nothing more starts until the Rollout changes.
	ReasonRefused = "Refused"
)

// haltReasons are the Progressing reasons that hold until a resume.
var haltReasons = []string{ReasonReadyTimeout, ReasonRemediation, ReasonHaltCondition}

// DefaultReadyTimeout is spec.halt.readyTimeout's default: a cluster not
// done this long after it started halts the rollout.
const DefaultReadyTimeout = 30 * time.Minute

// NoWave is the wave value shown for clusters without the wave label:
// they form the last wave.
const NoWave = "(none)"

// ClusterInput is one cluster and what its progress is read from.
type ClusterInput struct {
	Cluster       *typesv1.Cluster
	ControlPlanes []*typesv1.ControlPlane
	Deployments   []*typesv1.MachineDeployment
	HealthChecks  []*typesv1.HealthCheck
	// Remediations are when a HealthCheck of the cluster remediated a
	// machine (the cluster's "Remediated" events).
	Remediations []time.Time
}

// Input is what Plan decides from.
type Input struct {
	Rollout *typesv1.Rollout
	// Clusters are every cluster; Plan keeps those the selector (and, for
	// a class change, the class) chooses, and those it started.
	Clusters []ClusterInput
}

// Plan is what Decide decided.
type Plan struct {
	// Status is the Rollout's new status. The executor stores it before
	// it performs Actions.
	Status *typesv1.RolloutStatus
	// Actions move clusters the stored status records as started.
	Actions []Action
	// Started are the clusters this plan starts (recorded in Status):
	// they move from the next plan on, once Status is stored.
	Started []string
	// Replan asks for another plan as soon as Status is stored (clusters
	// were started and wait for their first move).
	Replan bool
	// Requeue is when to plan again at the latest (a bake or a timeout
	// that runs out); 0: nothing is timed.
	Requeue time.Duration
}

// Action is one write that moves a cluster.
type Action interface {
	isAction()
	String() string
}

// SetControlPlane sets a ControlPlane's version, or its image reference,
// to the change's.
type SetControlPlane struct {
	Cluster, ControlPlane string
	Set                   Fields
}

// SetDeployment sets a MachineDeployment's version or image reference.
type SetDeployment struct {
	Cluster, Deployment string
	Set                 Fields
}

// SetClusterVersion sets Cluster.spec.kubernetesVersion once its control
// planes run the version.
type SetClusterVersion struct{ Cluster, Version string }

// SetTopologyVersion sets Cluster.spec.topology.version.
type SetTopologyVersion struct{ Cluster, Version string }

// SetClassRevision sets Cluster.status.topology.classRevision, the
// revision of its class a topology cluster follows.
type SetClassRevision struct {
	Cluster  string
	Revision int64
}

// Fields are what a SetControlPlane or SetDeployment writes: Version when
// not empty; the image reference (Image or ImageSelector, the other
// cleared) when SetImage.
type Fields struct {
	Version       string
	SetImage      bool
	Image         string
	ImageSelector map[string]string
}

func (f Fields) String() string {
	var parts []string
	if f.Version != "" {
		parts = append(parts, "version="+f.Version)
	}
	if f.SetImage {
		if f.Image != "" {
			parts = append(parts, "image="+f.Image)
		} else {
			parts = append(parts, "imageSelector="+selectorString(f.ImageSelector))
		}
	}
	return strings.Join(parts, " ")
}

func (SetControlPlane) isAction()    {}
func (SetDeployment) isAction()      {}
func (SetClusterVersion) isAction()  {}
func (SetTopologyVersion) isAction() {}
func (SetClassRevision) isAction()   {}

func (a SetControlPlane) String() string {
	return fmt.Sprintf("SetControlPlane %s/%s %s", a.Cluster, a.ControlPlane, a.Set)
}
func (a SetDeployment) String() string {
	return fmt.Sprintf("SetDeployment %s/%s %s", a.Cluster, a.Deployment, a.Set)
}
func (a SetClusterVersion) String() string {
	return fmt.Sprintf("SetClusterVersion %s version=%s", a.Cluster, a.Version)
}
func (a SetTopologyVersion) String() string {
	return fmt.Sprintf("SetTopologyVersion %s version=%s", a.Cluster, a.Version)
}
func (a SetClassRevision) String() string {
	return fmt.Sprintf("SetClassRevision %s revision=%d", a.Cluster, a.Revision)
}

// Decide decides the next step of in.Rollout at now.
func Decide(in Input, now time.Time) Plan {
	r := in.Rollout
	spec := r.GetSpec()
	gen := r.GetMetadata().GetGeneration()
	st := proto.Clone(r.GetStatus()).(*typesv1.RolloutStatus)
	if st == nil {
		st = &typesv1.RolloutStatus{}
	}
	st.ObservedGeneration = gen
	ch := change{spec.GetChange()}
	p := Plan{Status: st}
	byName := make(map[string]ClusterInput, len(in.Clusters))
	for _, c := range in.Clusters {
		byName[c.Cluster.GetMetadata().GetName()] = c
	}
	waveLabel := cmp.Or(spec.GetWaveLabel(), validation.DefaultWaveLabel)
	maxConc := max(1, int(spec.GetMaxConcurrent()))
	bake := parseDuration(spec.GetBake(), 0)
	readyTimeout := parseDuration(spec.GetHalt().GetReadyTimeout(), DefaultReadyTimeout)

	// Resume: a new spec.resume lifts a halt; the clusters still moving
	// get a fresh readyTimeout, and halt rules look only at what happens
	// from now on.
	progressing := conditions.Get(st.GetConditions(), ConditionProgressing)
	halted := progressing != nil && progressing.GetStatus() == conditions.False && slices.Contains(haltReasons, progressing.GetReason())
	if spec.GetResume() > st.GetResumed() {
		st.Resumed = spec.GetResume()
		if halted {
			halted = false
			st.HaltedWave = ""
			st.ResumeTime = timestamppb.New(now)
			for _, rc := range st.GetClusters() {
				if rc.GetState() == ClusterInProgress {
					rc.StartTime = timestamppb.New(now)
				}
			}
		}
	}

	// Progress of the started clusters; moves for those still moving.
	recorded := map[string]*typesv1.RolloutCluster{}
	for _, rc := range st.GetClusters() {
		recorded[rc.GetName()] = rc
		if rc.GetState() != ClusterInProgress {
			continue
		}
		c, ok := byName[rc.GetName()]
		if !ok {
			rc.State, rc.DoneTime, rc.Message = ClusterDone, timestamppb.New(now), "cluster deleted"
			continue
		}
		done, why, acts := ch.progress(c)
		if done {
			rc.State, rc.DoneTime, rc.Message = ClusterDone, timestamppb.New(now), ""
			continue
		}
		rc.Message = why
		p.Actions = append(p.Actions, acts...)
	}

	// The waves: the clusters chosen, plus those started (in the wave
	// they started in).
	waveOf := map[string]string{}
	for _, c := range in.Clusters {
		name := c.Cluster.GetMetadata().GetName()
		if _, ok := recorded[name]; ok || !ch.targets(c.Cluster, spec.GetClusterSelector()) {
			continue
		}
		v, ok := c.Cluster.GetMetadata().GetLabels()[waveLabel]
		if !ok || v == "" {
			v = NoWave
		}
		waveOf[name] = v
	}
	for name, rc := range recorded {
		waveOf[name] = rc.GetWave()
	}
	waves := groupWaves(waveOf)

	// Refusal: a change that would break a cluster not yet started (a
	// skipped minor, a downgrade) starts nothing more, naming them.
	var refused []string
	for _, w := range waves {
		for _, name := range w.clusters {
			if _, ok := recorded[name]; ok {
				continue
			}
			if why := ch.refuse(byName[name]); why != "" {
				refused = append(refused, why)
			}
		}
	}

	// Where the rollout is: the first wave not done is current; the one
	// before it bakes until bake has passed since its last cluster was
	// done.
	cur := -1
	for i, w := range waves {
		if !w.done(recorded) {
			cur = i
			break
		}
	}
	bakeLeft := time.Duration(0)
	prev := len(waves) - 1
	if cur >= 0 {
		prev = cur - 1
	}
	if prev >= 0 && cur >= 0 {
		if end := waves[prev].doneTime(recorded).Add(bake); now.Before(end) {
			bakeLeft = end.Sub(now)
		}
	}

	// Halt rules, over the started clusters of the current wave and of
	// the wave baking.
	var haltReason, haltMsg, haltWave string
	if !halted {
		check := []int{}
		if cur >= 0 {
			check = append(check, cur)
		}
		if prev >= 0 && (bakeLeft > 0 || cur < 0) {
			check = append(check, prev)
		}
		since := st.GetResumeTime().AsTime()
		for _, i := range check {
			for _, name := range waves[i].clusters {
				rc, ok := recorded[name]
				c, exists := byName[name]
				if !ok || !exists {
					continue
				}
				from := rc.GetStartTime().AsTime()
				if since.After(from) {
					from = since
				}
				reason, msg, wait := haltCheck(spec.GetHalt(), c, rc, from, readyTimeout, now)
				p.Requeue = minPositive(p.Requeue, wait)
				if reason != "" && haltReason == "" {
					haltReason, haltMsg, haltWave = reason, fmt.Sprintf("wave %s: %s", waves[i].value, msg), waves[i].value
				}
			}
		}
		if haltReason != "" {
			halted = true
			st.HaltedWave = haltWave
		}
	} else {
		// Still halted: the stored reason and the halted wave's message,
		// with what still moves counted again below.
		haltReason, haltMsg = progressing.GetReason(), oldWaveMessage(r.GetStatus(), st.GetHaltedWave())
	}

	// Start clusters of the current wave.
	stopped := halted || len(refused) > 0 || spec.GetPaused() || spec.GetAborted()
	if !stopped && cur >= 0 && bakeLeft == 0 {
		w := waves[cur]
		moving := 0
		for _, name := range w.clusters {
			if rc, ok := recorded[name]; ok && rc.GetState() == ClusterInProgress {
				moving++
			}
		}
		for _, name := range w.clusters {
			if moving >= maxConc {
				break
			}
			if _, ok := recorded[name]; ok {
				continue
			}
			rc := &typesv1.RolloutCluster{Name: name, Wave: w.value, State: ClusterInProgress,
				StartTime: timestamppb.New(now), From: ch.from(byName[name]), Message: "started"}
			st.Clusters = append(st.Clusters, rc)
			recorded[name] = rc
			p.Started = append(p.Started, name)
			moving++
		}
	}
	p.Replan = len(p.Started) > 0

	// Timers: the bake, and the readyTimeout of moving clusters.
	if bakeLeft > 0 && !stopped {
		p.Requeue = minPositive(p.Requeue, bakeLeft)
	}
	for _, rc := range st.GetClusters() {
		if rc.GetState() == ClusterInProgress {
			start := rc.GetStartTime().AsTime()
			if left := start.Add(readyTimeout).Sub(now); left > 0 {
				p.Requeue = minPositive(p.Requeue, left)
			}
		}
	}

	// Status: waves, phase, conditions.
	st.Waves = st.Waves[:0]
	allDone := cur < 0 && len(waves) > 0
	for i, w := range waves {
		ws := &typesv1.RolloutWave{Value: w.value, Clusters: w.clusters, State: WaveWaiting}
		for _, name := range w.clusters {
			switch recorded[name].GetState() {
			case ClusterDone:
				ws.Done = append(ws.Done, name)
			case ClusterInProgress:
				ws.InProgress = append(ws.InProgress, name)
			}
		}
		if w.done(recorded) {
			ws.DoneTime = timestamppb.New(w.doneTime(recorded))
			ws.State = WaveDone
		}
		switch {
		case halted && w.value == st.GetHaltedWave():
			ws.State = WaveHalted
			ws.Message = haltMsg
		case i == prev && bakeLeft > 0:
			ws.State = WaveBaking
			ws.Message = fmt.Sprintf("baking: %s left of %s", bakeLeft.Round(time.Second), bake)
		case i == cur && len(ws.InProgress)+len(ws.Done) > 0:
			ws.State = WaveInProgress
			var msgs []string
			for _, name := range ws.InProgress {
				msgs = append(msgs, name+": "+recorded[name].GetMessage())
			}
			ws.Message = strings.Join(msgs, "; ")
		}
		st.Waves = append(st.Waves, ws)
	}

	conds := st.GetConditions()
	set := func(t, status, reason, msg, severity string) {
		c := conditions.New(t, status, reason, msg)
		c.ObservedGeneration = gen
		c.Severity = severity
		conds, _ = conditions.Set(conds, c, now)
	}
	moving := 0
	for _, rc := range st.GetClusters() {
		if rc.GetState() == ClusterInProgress {
			moving++
		}
	}
	finishing := ""
	if moving > 0 {
		finishing = fmt.Sprintf("; %d cluster(s) already moving finish", moving)
	}
	switch {
	case spec.GetAborted():
		st.Phase = PhaseAborted
		set(ConditionProgressing, conditions.False, ReasonAborted, "aborted (kilnctl rollout abort): no cluster starts any more"+finishing, "")
	case halted:
		st.Phase = PhaseHalted
		set(ConditionProgressing, conditions.False, haltReason, haltMsg+"; no cluster starts until kilnctl rollout resume"+finishing, "Warning")
	case len(refused) > 0:
		st.Phase = PhaseHalted
		set(ConditionProgressing, conditions.False, ReasonRefused, "the change would break "+strings.Join(refused, "; ")+": no cluster starts; change the Rollout"+finishing, "Warning")
	case allDone:
		st.Phase = PhaseComplete
		conds, _ = conditions.Remove(conds, ConditionProgressing)
	case spec.GetPaused():
		st.Phase = PhasePaused
		set(ConditionProgressing, conditions.False, ReasonPaused, "paused (kilnctl rollout resume goes on)"+finishing, "")
	case len(waves) == 0:
		st.Phase = PhasePending
		set(ConditionProgressing, conditions.False, ReasonNoClusters, "no cluster matches "+ch.describeTargets(spec.GetClusterSelector()), "")
	case bakeLeft > 0:
		st.Phase = PhaseBaking
		set(ConditionProgressing, conditions.True, ReasonBaking, fmt.Sprintf("wave %s done; baking %s before wave %s", waves[prev].value, bakeLeft.Round(time.Second), waves[cur].value), "")
	default:
		st.Phase = PhaseProgressing
		msg := ""
		if cur >= 0 {
			msg = "wave " + waves[cur].value + ": " + st.Waves[cur].GetMessage()
		}
		set(ConditionProgressing, conditions.True, ReasonRolling, msg, "")
	}
	total, done := 0, 0
	for _, w := range waves {
		total += len(w.clusters)
		for _, name := range w.clusters {
			if recorded[name].GetState() == ClusterDone {
				done++
			}
		}
	}
	if allDone {
		set(ConditionComplete, conditions.True, ReasonComplete, fmt.Sprintf("%d clusters in %d waves at %s", total, len(waves), ch), "")
	} else {
		// Not a problem, so no False condition (kilnctl shows those as
		// what blocks): the count goes into Progressing's message.
		conds, _ = conditions.Remove(conds, ConditionComplete)
		if c := conditions.Get(conds, ConditionProgressing); c != nil {
			c.Message = strings.TrimPrefix(c.GetMessage()+fmt.Sprintf("; %d of %d clusters at %s", done, total, ch), "; ")
		}
	}
	st.Conditions = conds
	return p
}

// oldWaveMessage is the stored message of wave value: a halted wave
// keeps the halt's.
func oldWaveMessage(st *typesv1.RolloutStatus, value string) string {
	for _, w := range st.GetWaves() {
		if w.GetValue() == value {
			return w.GetMessage()
		}
	}
	return ""
}

// haltCheck applies the halt rules to one started cluster c (record rc)
// looking at what happened from from on. It returns a reason and message
// when the rollout must halt, else how long until a timer runs out.
func haltCheck(h *typesv1.RolloutHalt, c ClusterInput, rc *typesv1.RolloutCluster, from time.Time, readyTimeout time.Duration, now time.Time) (reason, msg string, wait time.Duration) {
	name := rc.GetName()
	if rc.GetState() == ClusterInProgress {
		if age := now.Sub(rc.GetStartTime().AsTime()); age >= readyTimeout {
			return ReasonReadyTimeout, fmt.Sprintf("cluster %s not done %s after it started (halt.readyTimeout %s): %s",
				name, age.Round(time.Second), readyTimeout, rc.GetMessage()), 0
		}
	}
	if h.GetOnRemediation() {
		for _, t := range c.Remediations {
			if t.After(from) {
				return ReasonRemediation, fmt.Sprintf("a HealthCheck of cluster %s remediated a machine at %s", name, t.UTC().Format(time.RFC3339)), 0
			}
		}
		for _, hc := range c.HealthChecks {
			s := hc.GetStatus()
			if s.GetCurrentHealthy() < s.GetExpectedMachines() {
				return ReasonRemediation, fmt.Sprintf("HealthCheck %s of cluster %s: %d of %d machines unhealthy",
					hc.GetMetadata().GetName(), name, s.GetExpectedMachines()-s.GetCurrentHealthy(), s.GetExpectedMachines()), 0
			}
		}
	}
	for _, rule := range h.GetConditions() {
		timeout := parseDuration(rule.GetTimeout(), 0)
		for _, o := range conditionHolders(c) {
			cond := conditions.Get(o.conds, rule.GetType())
			if cond == nil || cond.GetStatus() != rule.GetStatus() {
				continue
			}
			since := cond.GetLastTransitionTime().AsTime()
			if since.Before(from) {
				since = from
			}
			held := now.Sub(since)
			if held < timeout {
				wait = minPositive(wait, timeout-held)
				continue
			}
			m := fmt.Sprintf("%s has %s=%s", o.name, rule.GetType(), rule.GetStatus())
			if timeout > 0 {
				m += fmt.Sprintf(" for %s (timeout %s)", held.Round(time.Second), timeout)
			}
			if cond.GetReason() != "" || cond.GetMessage() != "" {
				m += ": " + strings.TrimPrefix(cond.GetReason()+": "+cond.GetMessage(), ": ")
			}
			return ReasonHaltCondition, m, 0
		}
	}
	return "", "", wait
}

type holder struct {
	name  string
	conds []*typesv1.Condition
}

// conditionHolders are the objects whose conditions halt rules read:
// the Cluster, its ControlPlanes and its MachineDeployments.
func conditionHolders(c ClusterInput) []holder {
	out := []holder{{"cluster " + c.Cluster.GetMetadata().GetName(), c.Cluster.GetStatus().GetConditions()}}
	for _, cp := range c.ControlPlanes {
		out = append(out, holder{"control plane " + cp.GetMetadata().GetName(), cp.GetStatus().GetConditions()})
	}
	for _, md := range c.Deployments {
		out = append(out, holder{"machine deployment " + md.GetMetadata().GetName(), md.GetStatus().GetConditions()})
	}
	return out
}

// wave is the clusters of one value of the wave label.
type wave struct {
	value    string
	clusters []string
}

func (w wave) done(recorded map[string]*typesv1.RolloutCluster) bool {
	for _, name := range w.clusters {
		if recorded[name].GetState() != ClusterDone {
			return false
		}
	}
	return true
}

func (w wave) doneTime(recorded map[string]*typesv1.RolloutCluster) time.Time {
	var t time.Time
	for _, name := range w.clusters {
		if d := recorded[name].GetDoneTime().AsTime(); d.After(t) {
			t = d
		}
	}
	return t
}

// groupWaves orders the waves: numeric values in numeric order, then the
// other values in text order, then clusters without the label (NoWave).
// Clusters within a wave are in name order.
func groupWaves(waveOf map[string]string) []wave {
	by := map[string][]string{}
	for name, v := range waveOf {
		by[v] = append(by[v], name)
	}
	values := slices.Collect(maps.Keys(by))
	slices.SortFunc(values, compareWaves)
	out := make([]wave, 0, len(values))
	for _, v := range values {
		names := by[v]
		slices.Sort(names)
		out = append(out, wave{v, names})
	}
	return out
}

func compareWaves(a, b string) int {
	rank := func(v string) int {
		switch _, err := strconv.ParseFloat(v, 64); {
		case v == NoWave:
			return 2
		case err == nil:
			return 0
		}
		return 1
	}
	if ra, rb := rank(a), rank(b); ra != rb {
		return cmp.Compare(ra, rb)
	}
	if rank(a) == 0 {
		fa, _ := strconv.ParseFloat(a, 64)
		fb, _ := strconv.ParseFloat(b, 64)
		if c := cmp.Compare(fa, fb); c != 0 {
			return c
		}
	}
	return strings.Compare(a, b)
}

func parseDuration(s string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return d
	}
	return def
}

func minPositive(a, b time.Duration) time.Duration {
	switch {
	case a <= 0:
		return b
	case b <= 0:
		return a
	case b < a:
		return b
	}
	return a
}

func matches(labels, selector map[string]string) bool {
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func selectorString(sel map[string]string) string {
	keys := slices.Sorted(maps.Keys(sel))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + sel[k]
	}
	return strings.Join(parts, ",")
}
