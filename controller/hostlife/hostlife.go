// Package hostlife decides the lifecycle of a Host: given the stored host,
// what is wanted of it (an image to lay, or nothing), what was observed
// (the outcome of the last actions, the BMC's health) and the time, Plan
// returns the host's next status, the actions to run and when to look
// again. It does no I/O and reads no clock; controller/provision runs the
// actions and stores the status.
//
// States and the provisioning steps are those of docs/lifecycle.md:
//
//	Registering -> Inspecting -> Available -> Provisioning -> Provisioned
//	                                 ^                            |
//	                                 +-- Wiping <- Deprovisioning <+
//
// Every step is written ahead: Plan returns the status naming the step and
// its operation (state Running) together with the step's actions, and the
// executor stores that status before it runs them. A controller that
// crashes mid-step finds the step Running with no result and runs its
// (idempotent) actions again; agent operations keep their id, so the agent
// re-attaches instead of laying an image twice.
package hostlife

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/backoff"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/diskhint"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Step names a step of a state's sequence; it is stored in
// HostStatus.provisioning_step and OperationStatus.kind.
type Step string

// Steps.
const (
	StepCheckBMC       Step = "CheckBMC"
	StepPowerOff       Step = "PowerOff"
	StepBootAgentMedia Step = "BootAgentMedia"
	StepPowerOn        Step = "PowerOn"
	StepWaitBootAgent  Step = "WaitBootAgent"
	StepLayImage       Step = "LayImage"
	StepWriteIdentity  Step = "WriteIdentity"
	StepBootDisk       Step = "BootDisk"
	StepWaitInstalled  Step = "WaitInstalledAgent"
	StepWipe           Step = "Wipe"
	StepPowerOffWiped  Step = "PowerOffWiped"
)

// allSteps lists every Step, in lifecycle order.
var allSteps = []Step{StepCheckBMC, StepPowerOff, StepBootAgentMedia, StepPowerOn, StepWaitBootAgent,
	StepLayImage, StepWriteIdentity, StepBootDisk, StepWaitInstalled, StepWipe, StepPowerOffWiped}

// Steps returns every Step, in lifecycle order (a fresh slice).
func Steps() []Step { return append([]Step(nil), allSteps...) }

// ParseStep returns the Step named s, ignoring case ("layimage" is
// StepLayImage); an unknown name is an InvalidArgument error listing the
// steps.
func ParseStep(s string) (Step, error) {
	for _, st := range allSteps {
		if strings.EqualFold(s, string(st)) {
			return st, nil
		}
	}
	names := make([]string, len(allSteps))
	for i, st := range allSteps {
		names[i] = string(st)
	}
	return "", errdefs.InvalidArgument("unknown step %q: steps are %s", s, strings.Join(names, ", "))
}

// ActionKind is the closed set of things Plan asks the executor to do.
type ActionKind string

// Action kinds.
const (
	// ActCheckBMC reads the power state: proves the BMC answers with the
	// stored credentials.
	ActCheckBMC ActionKind = "CheckBMC"
	// ActPowerOff cuts power and waits until the BMC reports it off.
	ActPowerOff ActionKind = "PowerOff"
	// ActPowerOn powers on and waits until the BMC reports it on.
	ActPowerOn ActionKind = "PowerOn"
	// ActSetBoot sets the next boot device (Device, Persistent).
	ActSetBoot ActionKind = "SetBoot"
	// ActInsertMedia inserts the agent ISO at URL as virtual media.
	ActInsertMedia ActionKind = "InsertMedia"
	// ActLayImage asks the boot agent to lay Image on Target under
	// OperationID (a second call with the same id re-attaches).
	ActLayImage ActionKind = "LayImage"
	// ActWriteIdentity writes the host's identity into the laid image.
	ActWriteIdentity ActionKind = "WriteIdentity"
	// ActReboot asks the agent to reboot the host, unless the agent that
	// answers already runs in mode UnlessAgent.
	ActReboot ActionKind = "Reboot"
	// ActWipe asks the agent to wipe Target under OperationID.
	ActWipe ActionKind = "Wipe"
	// ActReattach asks the agent how operation OperationID ended, and
	// follows it while it runs; it never starts an operation (an agent
	// that does not know the id fails it). Before a timed-out lay is
	// retried from PowerOff: a lay that ended after the controller gave up
	// on it counts, instead of being laid again.
	ActReattach ActionKind = "Reattach"
)

// Boot devices of ActSetBoot (those of package bmc).
const (
	BootPXE   = "pxe"
	BootDisk  = "disk"
	BootCDROM = "cdrom"
)

// Operation states stored in OperationStatus.state.
const (
	OpRunning   = "Running"
	OpSucceeded = "Succeeded"
	OpFailed    = "Failed"
)

// Condition types and reasons Plan sets.
const (
	// ConditionProvisioned is True once the installed agent checked in
	// after a lay; False with the current step, or with the failure, while
	// not.
	ConditionProvisioned = "Provisioned"

	ReasonInProgress  = "InProgress"
	ReasonStepFailed  = "StepFailed"
	ReasonTransient   = "TransientFailure"
	ReasonUnreachable = "AgentUnreachable"
	ReasonTimedOut    = "StepTimedOut"
	// ReasonLateSuccess is the event of a timed-out agent operation that
	// the agent, asked before the retry, reports as succeeded.
	ReasonLateSuccess  = "SucceededAfterTimeout"
	ReasonBootSource   = "BootSourceMismatch"
	ReasonTooManyTries = "TooManyAttempts"
	ReasonDone         = "Provisioned"
	ReasonNotWanted    = "NotWanted"

	// ConditionImageResolved is False while the image the host's Machine
	// names cannot be used (Desired.Blocked).
	ConditionImageResolved = "ImageResolved"

	// ConditionBootAgentCheckedIn is False (BootAgentMissing) while
	// WaitBootAgent has waited longer than Config.ExpectedBoot since the
	// power on, and True (CheckedIn) once the boot agent came after that:
	// a host whose firmware boots nothing says so long before the step
	// times out.
	ConditionBootAgentCheckedIn = "BootAgentCheckedIn"
	ReasonBootAgentMissing      = "BootAgentMissing"
	ReasonCheckedIn             = "CheckedIn"
)

// Action is one thing to do against the host's BMC or agent.
type Action struct {
	Kind ActionKind
	// OperationID is the id of the step's operation; agent operations
	// (LayImage, Wipe) are started or re-attached under it.
	OperationID string
	// Device and Persistent are those of ActSetBoot.
	Device     string
	Persistent bool
	// URL is the agent ISO of ActInsertMedia.
	URL string
	// ImageName and Image are what ActLayImage lays.
	ImageName string
	Image     *typesv1.ImageSpec
	// Target and RootDevice name the disk of ActLayImage,
	// ActWriteIdentity and ActWipe: the host's spec.rootDiskHint (default
	// /dev/sda), or its spec.rootDeviceHints (Target then empty). The
	// agent resolves them to one disk from its facts, or refuses.
	Target     string
	RootDevice *typesv1.RootDeviceHints
	// UnlessAgent makes ActReboot a no-op when the agent answering runs
	// in this mode: BootDisk run again after a restart must not reboot an
	// installed agent that the first run's reboot already started (its
	// earlier check-in would then end WaitInstalledAgent while the host
	// reboots again).
	UnlessAgent string
}

func (a Action) String() string {
	var b strings.Builder
	b.WriteString(string(a.Kind))
	switch a.Kind {
	case ActSetBoot:
		fmt.Fprintf(&b, " device=%s persistent=%t", a.Device, a.Persistent)
	case ActInsertMedia:
		fmt.Fprintf(&b, " url=%s", a.URL)
	case ActLayImage:
		fmt.Fprintf(&b, " op=%s image=%s target=%s", a.OperationID, a.ImageName, a.disk())
	case ActWriteIdentity:
		fmt.Fprintf(&b, " target=%s", a.disk())
	case ActWipe:
		fmt.Fprintf(&b, " op=%s target=%s", a.OperationID, a.disk())
	case ActReattach:
		fmt.Fprintf(&b, " op=%s", a.OperationID)
	case ActReboot:
		if a.UnlessAgent != "" {
			fmt.Fprintf(&b, " unless=%s", a.UnlessAgent)
		}
	}
	return b.String()
}

// disk renders the action's disk: Target, or the structured hints.
func (a Action) disk() string {
	if a.RootDevice != nil {
		return "{" + diskhint.String(a.RootDevice) + "}"
	}
	return a.Target
}

// Desired is what is wanted of the host.
type Desired struct {
	// Machine is the Machine the host is bound to; empty when none.
	Machine string
	// ImageName and Image are the image to lay; Image nil wants no image
	// (a provisioned host is deprovisioned and wiped).
	ImageName string
	Image     *typesv1.ImageSpec
	// Blocked, when set, says why the wanted image (ImageName) cannot be
	// laid (it does not exist): the host does not start provisioning, or
	// holds its step, and carries the ImageResolved condition with it.
	Blocked *Blocked
}

// Blocked is why Desired's image cannot be used.
type Blocked struct {
	Reason, Message string
}

// Failure classes of a Result.
type Failure int

// Failure classes.
const (
	// FailTransient is a BMC call that failed: the host keeps its step and
	// tries again after a backoff, without limit (the BMCReachable
	// condition tells the operator).
	FailTransient Failure = iota + 1
	// FailUnreachable is an agent that could not be reached, or whose
	// connection broke before the operation ended: the operation stays
	// Running under its id and its actions run again after a backoff (the
	// agent re-attaches); the step's timeout still counts from its start.
	FailUnreachable
	// FailAgent is an agent operation that failed; it counts against
	// Config.MaxAttempts.
	FailAgent
	// FailPermanent cannot succeed by trying again (a BMC without virtual
	// media, a bad image spec): the host goes to Error.
	FailPermanent
)

// Result is the outcome of the actions the executor ran for the stored
// operation OperationID.
type Result struct {
	OperationID string
	// Err is empty on success.
	Err     string
	Failure Failure
	// Consecutive counts the host's consecutive transient failures (for
	// the backoff of FailTransient).
	Consecutive int
}

// Observed is what the executor saw.
type Observed struct {
	// Result is the outcome of the last actions run, or nil when none ran
	// since the status was read (a restarted controller).
	Result *Result
	// BMCCondition is the BMC's BMCReachable condition, or nil.
	BMCCondition *typesv1.Condition
}

// Config tunes Plan.
type Config struct {
	// Timeouts bounds each step, measured from its start (for the waits:
	// from the power on or reboot that started the boot). Missing steps
	// get DefaultTimeouts(), then DefaultTimeout. kiln-controller run
	// sets them with --step-timeout STEP=DURATION.
	Timeouts       map[Step]time.Duration
	DefaultTimeout time.Duration
	// Backoff spaces retries of failed steps.
	Backoff backoff.Policy
	// MaxAttempts is how many agent failures or timeouts one state run
	// tolerates before Error (default 3).
	MaxAttempts int
	// PollInterval is how often a waiting step looks again when nothing
	// else wakes it (default 10s).
	PollInterval time.Duration
	// ExpectedBoot is how long a host normally takes from power on to its
	// boot agent's first check-in (default DefaultExpectedBoot). Past it,
	// WaitBootAgent keeps waiting until its timeout but the host carries
	// BootAgentCheckedIn=False, reason BootAgentMissing.
	ExpectedBoot time.Duration
}

// ReattachTimeout bounds ActReattach, and the one more run of a step's
// actions found past its timeout with no result seen (the step's timeout
// bounds both too): how long a timed-out lay that still runs is followed
// before the retry powers the host off.
const ReattachTimeout = time.Minute

// Default values of Config.
const (
	DefaultStepTimeout  = 10 * time.Minute
	DefaultMaxAttempts  = 3
	DefaultPollInterval = 10 * time.Second
	// DefaultExpectedBoot allows for slow firmware (servers with much
	// memory take minutes to POST) before a missing boot agent is called
	// out; the step itself waits DefaultTimeouts()[StepWaitBootAgent].
	DefaultExpectedBoot = 5 * time.Minute
)

// DefaultTimeouts returns the step timeouts of a real rack (a fresh map:
// changing it changes nothing; set Config.Timeouts instead).
func DefaultTimeouts() map[Step]time.Duration {
	m := make(map[Step]time.Duration, len(defaultTimeouts))
	for s, d := range defaultTimeouts {
		m[s] = d
	}
	return m
}

var defaultTimeouts = map[Step]time.Duration{
	StepCheckBMC:       2 * time.Minute,
	StepPowerOff:       3 * time.Minute,
	StepBootAgentMedia: 3 * time.Minute,
	StepPowerOn:        3 * time.Minute,
	StepWaitBootAgent:  15 * time.Minute,
	StepLayImage:       30 * time.Minute,
	StepWriteIdentity:  2 * time.Minute,
	StepBootDisk:       3 * time.Minute,
	StepWaitInstalled:  15 * time.Minute,
	StepWipe:           30 * time.Minute,
	StepPowerOffWiped:  3 * time.Minute,
}

func (c Config) withDefaults() Config {
	if c.DefaultTimeout <= 0 {
		c.DefaultTimeout = DefaultStepTimeout
	}
	if c.Backoff == (backoff.Policy{}) {
		c.Backoff = backoff.Policy{Base: 5 * time.Second, Max: 5 * time.Minute, Factor: 2, Jitter: 0.2}
	}
	if c.MaxAttempts <= 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.PollInterval <= 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.ExpectedBoot <= 0 {
		c.ExpectedBoot = DefaultExpectedBoot
	}
	return c
}

func (c Config) timeout(s Step) time.Duration {
	if d, ok := c.Timeouts[s]; ok && d > 0 {
		return d
	}
	if d, ok := defaultTimeouts[s]; ok {
		return d
	}
	return c.DefaultTimeout
}

// Input is everything Plan decides on.
type Input struct {
	Host     *typesv1.Host
	Desired  Desired
	Observed Observed
	// ISOURL is the host's agent boot ISO (virtual media of Redfish hosts).
	ISOURL string
	Now    time.Time
	Config Config
}

// Event is something worth telling the operator (controller/events).
type Event struct {
	// Type is "Normal" or "Warning".
	Type    string
	Reason  string
	Message string
}

// Next says when to plan the host again, once Status is stored (and
// Actions, if any, have run).
type Next int

// When to plan again.
const (
	// NextOnChange: only when something changes (a watch event: a
	// heartbeat, an apply). The host rests: Provisioned, Available with
	// nothing wanted, Error.
	NextOnChange Next = iota
	// NextAfter: after Output.RequeueAfter, or sooner on a change (a wait
	// step polls, a failed step waits out its backoff).
	NextAfter
	// NextNow: at once. Without Actions: the stored status is what the
	// next Plan decides on (a wait step found done as it started). With
	// Actions: with their Result as soon as they end.
	NextNow
)

func (n Next) String() string {
	switch n {
	case NextOnChange:
		return "on-change"
	case NextAfter:
		return "after"
	case NextNow:
		return "now"
	}
	return fmt.Sprintf("Next(%d)", int(n))
}

// Output is Plan's decision.
type Output struct {
	// Status is the host's new status (a copy; the input is not changed).
	Status *typesv1.HostStatus
	// Changed is true when Status differs from the stored one and must be
	// written before Actions run.
	Changed bool
	// Actions are to run in order, after Status is stored, within
	// Deadline (what is left of the step's timeout); then Plan is called
	// again with their Result (Next is NextNow).
	Actions  []Action
	Deadline time.Duration
	// Next is when to plan again; RequeueAfter is the delay of NextAfter
	// (0 otherwise).
	Next         Next
	RequeueAfter time.Duration
	Events       []Event
	// Finished are the operations (steps) this plan ended, for metrics:
	// report them once Status is stored.
	Finished []Finished
	// Deferrable is true when Status need not be stored before Actions
	// run, nor before the next Plan (Next is NextNow): the write-ahead
	// rule asks that a status recording "about to do X" be stored before
	// X when a restart must know X may have happened (power, a lay, a
	// wipe, a reboot). These actions start nothing of the kind: a read of
	// the BMC's power state (CheckBMC), or the agent ISO and the one-time
	// boot device (BootAgentMedia), which a restart that finds the step
	// before them stored simply sets again after running that step again;
	// or there are no actions and the status is a pure observation that
	// the next Plan decides on at once (a wait step found done as it
	// starts). The executor may then hold Status and store it, with its
	// Events, in the next plan's write; that write comes before any action
	// that is not deferrable and before the executor stops.
	Deferrable bool
}

// Finished is an operation that ended: its kind (the step), how, and how
// long it ran from its start to this plan's Now. A wait step started
// with the step before it (WaitBootAgent counts from the power on).
type Finished struct {
	Kind     Step
	Outcome  string
	Duration time.Duration
}

// Outcomes of Finished.
const (
	OutcomeSuccess = "success"
	OutcomeFailure = "failure"
	OutcomeTimeout = "timeout"
)

// result is what a handler decided. The set is closed (the unexported
// method): actionContinue, actionUpdate, actionRun, actionComplete and
// actionFailed, after the action results of Metal3's baremetal-operator.
// Plan turns it into Output.Next, RequeueAfter, Actions and Deadline.
type result interface {
	apply(out *Output)
}

// actionContinue: nothing to run now; look again after delay (a wait
// step's poll, a backoff), or sooner on a change.
type actionContinue struct{ delay time.Duration }

func (r actionContinue) apply(out *Output) {
	if r.delay <= 0 {
		out.Next = NextNow // the moment already came
		return
	}
	out.Next, out.RequeueAfter = NextAfter, r.delay
}

// actionUpdate: the status changed in a way the next Plan decides on
// (a wait step already satisfied, or failed, as it starts): store it and
// plan again at once.
type actionUpdate struct{}

func (actionUpdate) apply(out *Output) { out.Next = NextNow }

// actionRun: store the status, run actions within deadline, and plan again
// with their Result.
type actionRun struct {
	actions  []Action
	deadline time.Duration
}

func (r actionRun) apply(out *Output) {
	out.Actions, out.Deadline, out.Next = r.actions, r.deadline, NextNow
}

// actionComplete: the host rests in its state (Provisioned, Available
// with nothing wanted) until something changes.
type actionComplete struct{}

func (actionComplete) apply(out *Output) { out.Next = NextOnChange }

// actionFailed: the host is in Error for reason (the status says why)
// until its spec changes or its image is no longer wanted.
type actionFailed struct{ reason string }

func (actionFailed) apply(out *Output) { out.Next = NextOnChange }

// deferrable reports whether the status of r may be stored with the next
// write (Output.Deferrable): a wait step found done as it starts, or
// actions that are all reads of the BMC or boot settings for the next
// boot only.
func deferrable(r result) bool {
	switch r := r.(type) {
	case actionUpdate:
		return true
	case actionRun:
		for _, a := range r.actions {
			switch {
			case a.Kind == ActCheckBMC, a.Kind == ActInsertMedia:
			case a.Kind == ActSetBoot && !a.Persistent:
			default:
				return false
			}
		}
		return len(r.actions) > 0
	}
	return false
}

// BYOH reports whether h has no BMC (protocol "none" or empty): such
// hosts skip power and imaging.
func BYOH(h *typesv1.Host) bool {
	p := h.GetSpec().GetBmc().GetProtocol()
	return p == "" || p == "none"
}

// Plan decides what to do next with in.Host.
func Plan(in Input) Output {
	in.Config = in.Config.withDefaults()
	st := proto.Clone(in.Host.GetStatus()).(*typesv1.HostStatus)
	if st == nil {
		st = &typesv1.HostStatus{}
	}
	p := &planner{in: in, st: st, name: in.Host.GetMetadata().GetName()}
	if c := in.Observed.BMCCondition; c != nil && !BYOH(in.Host) {
		p.st.Conditions, _ = conditions.Set(p.st.Conditions, proto.Clone(c).(*typesv1.Condition), in.Now)
	}
	r := p.run()
	out := p.out // the events
	r.apply(&out)
	out.Deferrable = deferrable(r)
	out.Status = p.st
	out.Changed = !proto.Equal(p.st, in.Host.GetStatus())
	return out
}

// planner carries one Plan call.
type planner struct {
	in   Input
	st   *typesv1.HostStatus
	name string
	out  Output
}

// handler decides for one state and returns what it decided (a result:
// a closed set). Handlers change p.st and add events; they never touch
// p.out's decision fields.
type handler func(p *planner) result

// handlers is the lifecycle: one handler per state.
var handlers = map[typesv1.HostState]handler{
	typesv1.HostState_HOST_STATE_UNSPECIFIED:    (*planner).registering,
	typesv1.HostState_HOST_STATE_REGISTERING:    (*planner).registering,
	typesv1.HostState_HOST_STATE_INSPECTING:     (*planner).inspecting,
	typesv1.HostState_HOST_STATE_AVAILABLE:      (*planner).available,
	typesv1.HostState_HOST_STATE_PROVISIONING:   (*planner).provisioning,
	typesv1.HostState_HOST_STATE_PROVISIONED:    (*planner).provisioned,
	typesv1.HostState_HOST_STATE_DEPROVISIONING: (*planner).deprovisioning,
	typesv1.HostState_HOST_STATE_WIPING:         (*planner).wiping,
	typesv1.HostState_HOST_STATE_ERROR:          (*planner).errored,
}

func (p *planner) run() result {
	h, ok := handlers[p.st.GetState()]
	if !ok {
		return p.fail("UnknownState", fmt.Sprintf("unknown state %v", p.st.GetState()))
	}
	return h(p)
}

// StateName is the short name of a state ("Provisioning").
func StateName(s typesv1.HostState) string {
	n := strings.TrimPrefix(s.String(), "HOST_STATE_")
	if n == "" {
		return ""
	}
	return n[:1] + strings.ToLower(n[1:])
}

// wantsImage reports whether an image is wanted.
func (p *planner) wantsImage() bool { return p.in.Desired.Image != nil || p.in.Desired.Blocked != nil }

// imageBlocked reports whether the wanted image cannot be used now: it
// sets ImageResolved False with why (the caller looks again after
// PollInterval). Otherwise a False ImageResolved left from before becomes
// True.
func (p *planner) imageBlocked() bool {
	b := p.in.Desired.Blocked
	if b == nil {
		if c := conditions.Get(p.st.GetConditions(), ConditionImageResolved); c != nil && c.GetStatus() != conditions.True {
			p.st.Conditions, _ = conditions.Set(p.st.Conditions, conditions.New(ConditionImageResolved, conditions.True, "Resolved", "image "+p.in.Desired.ImageName), p.in.Now)
		}
		return false
	}
	c := conditions.New(ConditionImageResolved, conditions.False, b.Reason, b.Message)
	c.Severity = "Warning"
	var changed bool
	p.st.Conditions, changed = conditions.Set(p.st.Conditions, c, p.in.Now)
	if changed {
		p.event("Warning", b.Reason, b.Message)
	}
	return true
}

func (p *planner) registering() result {
	if p.st.GetState() == typesv1.HostState_HOST_STATE_UNSPECIFIED {
		p.transition(typesv1.HostState_HOST_STATE_REGISTERING, "host registered")
	}
	if BYOH(p.in.Host) {
		p.transition(typesv1.HostState_HOST_STATE_INSPECTING, "host without a BMC: waiting for its agent")
		return p.inspecting()
	}
	r := p.sequence([]stepDef{{name: StepCheckBMC, actions: func() []Action { return []Action{{Kind: ActCheckBMC}} }}},
		typesv1.HostState_HOST_STATE_INSPECTING, "bmc answers")
	if p.st.GetState() == typesv1.HostState_HOST_STATE_INSPECTING {
		return p.inspecting()
	}
	return r
}

func (p *planner) inspecting() result {
	if BYOH(p.in.Host) && p.st.GetAgent().GetLastHeartbeat() == nil {
		return p.wait(p.in.Config.PollInterval)
	}
	p.transition(typesv1.HostState_HOST_STATE_AVAILABLE, "host is available")
	return p.available()
}

func (p *planner) available() result {
	if !p.wantsImage() {
		return actionComplete{}
	}
	if p.imageBlocked() {
		return p.wait(p.in.Config.PollInterval)
	}
	p.st.Image = p.in.Desired.ImageName
	p.transition(typesv1.HostState_HOST_STATE_PROVISIONING,
		fmt.Sprintf("provisioning image %s for machine %s", p.in.Desired.ImageName, p.in.Desired.Machine))
	return p.provisioning()
}

func (p *planner) provisioning() result {
	if !p.wantsImage() || p.in.Desired.ImageName != p.st.GetImage() {
		p.transition(typesv1.HostState_HOST_STATE_DEPROVISIONING, "image no longer wanted: deprovisioning")
		return p.deprovisioning()
	}
	if p.imageBlocked() {
		return p.wait(p.in.Config.PollInterval)
	}
	r := p.sequence(p.provisionSteps(), typesv1.HostState_HOST_STATE_PROVISIONED, "installed agent checked in")
	if p.st.GetState() == typesv1.HostState_HOST_STATE_PROVISIONED {
		p.setProvisioned(conditions.True, ReasonDone, fmt.Sprintf("image %s laid and booted", p.st.GetImage()))
	}
	return r
}

func (p *planner) provisioned() result {
	if !p.wantsImage() || p.in.Desired.ImageName != p.st.GetImage() {
		p.transition(typesv1.HostState_HOST_STATE_DEPROVISIONING, "image no longer wanted: deprovisioning")
		p.setProvisioned(conditions.False, ReasonNotWanted, "deprovisioning")
		return p.deprovisioning()
	}
	return actionComplete{}
}

func (p *planner) deprovisioning() result {
	if BYOH(p.in.Host) {
		p.transition(typesv1.HostState_HOST_STATE_WIPING, "host without a BMC: nothing to boot")
		return p.wiping()
	}
	r := p.sequence(p.bootAgentSteps(), typesv1.HostState_HOST_STATE_WIPING, "boot agent checked in")
	if p.st.GetState() == typesv1.HostState_HOST_STATE_WIPING {
		return p.wiping()
	}
	return r
}

func (p *planner) wiping() result {
	if BYOH(p.in.Host) {
		p.st.Image = ""
		p.transition(typesv1.HostState_HOST_STATE_AVAILABLE, "host without a BMC: kubeadm reset belongs to the cluster")
		return p.available()
	}
	steps := []stepDef{
		{name: StepWipe, actions: func() []Action {
			return []Action{{Kind: ActWipe, OperationID: p.st.GetLastOperation().GetId(), Target: p.target(), RootDevice: p.rootDevice()}}
		}},
		{name: StepPowerOffWiped, actions: func() []Action { return []Action{{Kind: ActPowerOff}} }},
	}
	r := p.sequence(steps, typesv1.HostState_HOST_STATE_AVAILABLE, "disk wiped, host powered off")
	if p.st.GetState() == typesv1.HostState_HOST_STATE_AVAILABLE {
		p.st.Image = ""
		return p.available()
	}
	return r
}

// errored stays in Error until the image is no longer wanted, which
// deprovisions and wipes the host.
func (p *planner) errored() result {
	if g := p.in.Host.GetMetadata().GetGeneration(); p.st.GetErrorGeneration() > 0 && g > p.st.GetErrorGeneration() {
		p.st.ErrorGeneration = 0
		p.st.LastError = ""
		p.transition(typesv1.HostState_HOST_STATE_REGISTERING, fmt.Sprintf("host spec changed since the error (generation %d): trying again from registration", g))
		return p.registering()
	}
	if !p.wantsImage() {
		p.st.ErrorReason = ""
		p.transition(typesv1.HostState_HOST_STATE_DEPROVISIONING, "image no longer wanted: leaving Error to deprovision")
		return p.deprovisioning()
	}
	return actionFailed{reason: p.st.GetErrorReason()}
}

// target is the one-string root-disk hint actions carry: the spec's, or
// /dev/sda when the spec names no disk at all; empty when the spec has
// structured hints (rootDevice).
func (p *planner) target() string {
	if t := p.in.Host.GetSpec().GetRootDiskHint(); t != "" {
		return t
	}
	if p.rootDevice() != nil {
		return ""
	}
	return diskhint.Default
}

// rootDevice is the spec's structured root-disk hints, or nil.
func (p *planner) rootDevice() *typesv1.RootDeviceHints {
	if h := p.in.Host.GetSpec().GetRootDeviceHints(); !diskhint.Empty(h) {
		return h
	}
	return nil
}

// bootDevice is the one-time boot device of the agent media: virtual media
// on Redfish, PXE on IPMI.
func (p *planner) bootDevice() string {
	if p.in.Host.GetSpec().GetBmc().GetProtocol() == "ipmi" {
		return BootPXE
	}
	return BootCDROM
}

func (p *planner) bootAgentSteps() []stepDef {
	return []stepDef{
		{name: StepPowerOff, actions: func() []Action { return []Action{{Kind: ActPowerOff}} }},
		{name: StepBootAgentMedia, actions: func() []Action {
			if p.bootDevice() == BootCDROM {
				return []Action{{Kind: ActInsertMedia, URL: p.in.ISOURL}, {Kind: ActSetBoot, Device: BootCDROM}}
			}
			return []Action{{Kind: ActSetBoot, Device: BootPXE}}
		}},
		{name: StepPowerOn, actions: func() []Action { return []Action{{Kind: ActPowerOn}} }},
		{name: StepWaitBootAgent, retryFrom: StepPowerOff, wait: func() (bool, string) {
			return p.agentCheckedIn("boot", p.bootDevice())
		}},
	}
}

func (p *planner) provisionSteps() []stepDef {
	if BYOH(p.in.Host) {
		return []stepDef{{name: StepWaitInstalled, wait: func() (bool, string) { return p.agentCheckedIn("installed", "") }}}
	}
	return append(p.bootAgentSteps(),
		stepDef{name: StepLayImage, retryFrom: StepPowerOff, actions: func() []Action {
			return []Action{{Kind: ActLayImage, OperationID: p.st.GetLastOperation().GetId(),
				ImageName: p.in.Desired.ImageName, Image: p.in.Desired.Image, Target: p.target(), RootDevice: p.rootDevice()}}
		}},
		stepDef{name: StepWriteIdentity, retryFrom: StepPowerOff, pastLay: true, actions: func() []Action {
			return []Action{{Kind: ActWriteIdentity, Target: p.target(), RootDevice: p.rootDevice()}}
		}},
		stepDef{name: StepBootDisk, retryFrom: StepPowerOff, pastLay: true, actions: func() []Action {
			return []Action{{Kind: ActSetBoot, Device: BootDisk, Persistent: true}, {Kind: ActReboot, UnlessAgent: "installed"}}
		}},
		stepDef{name: StepWaitInstalled, retryFrom: StepBootDisk, wait: func() (bool, string) {
			// The boot agent may still check in between the reboot request
			// and the reboot: not a mismatch. If it is all that ever
			// checks in, the step times out saying so.
			if p.st.GetAgent().GetMode() == "boot" {
				return false, ""
			}
			return p.agentCheckedIn("installed", BootDisk)
		}},
	)
}

// agentCheckedIn reports whether an agent in mode heartbeated since the
// wait began and, when device is set, booted from it. A heartbeat of the
// wrong boot source is a failure (mismatch != success).
func (p *planner) agentCheckedIn(mode, device string) (bool, string) {
	a := p.st.GetAgent()
	since := p.st.GetLastOperation().GetStarted().AsTime()
	if a.GetLastHeartbeat() == nil || a.GetLastHeartbeat().AsTime().Before(since) {
		return false, ""
	}
	// An agent that has not told its address yet (its first heartbeat can
	// come before it knows its route to the controller) cannot be called.
	if a.GetAddress() == "" {
		return false, ""
	}
	if device != "" {
		if msg := verifyBoot(device, a.GetBootSource()); msg != "" {
			return false, msg
		}
	}
	if a.GetMode() != mode {
		return false, fmt.Sprintf("asked for the %s agent, the %s agent checked in", mode, a.GetMode())
	}
	return true, ""
}

// verifyBoot compares the asked boot device with the agent's boot source
// (as bmc.VerifyBoot does) and explains a mismatch.
func verifyBoot(asked, reported string) string {
	canon := func(s string) string {
		switch strings.ToLower(strings.TrimSpace(s)) {
		case "pxe", "network":
			return BootPXE
		case "disk", "hdd":
			return BootDisk
		case "cdrom", "cd", "dvd", "virtualmedia":
			return BootCDROM
		}
		return ""
	}
	r := canon(reported)
	if r == "" {
		return fmt.Sprintf("asked to boot from %s, the agent reports unknown boot source %q", asked, reported)
	}
	if r != asked {
		return fmt.Sprintf("asked to boot from %s, the host booted from %s", asked, r)
	}
	return ""
}

// stepDef is one step: either actions to run, or a wait for a condition.
type stepDef struct {
	name    Step
	actions func() []Action
	// wait reports done, or a mismatch that is a permanent failure.
	wait func() (done bool, mismatch string)
	// retryFrom is where the step starts again after it timed out
	// (default: itself). Steps that need the boot agent start again from
	// PowerOff: a boot agent that is gone cannot be waited back.
	retryFrom Step
	// pastLay marks a step after the lay whose retry from retryFrom lays
	// the image again: an unreachable agent is asked until
	// ReattachTimeout past the step's timeout before it times out.
	pastLay bool
}

// sequence drives the state's steps; when the last one succeeds the host
// moves to done (and the result is actionComplete: the caller goes on in
// done's handler).
func (p *planner) sequence(steps []stepDef, done typesv1.HostState, doneMsg string) result {
	idx := -1
	for i, s := range steps {
		if string(s.name) == p.st.GetProvisioningStep() {
			idx = i
		}
	}
	op := p.st.GetLastOperation()
	if idx < 0 || op.GetKind() != string(steps[idx].name) {
		return p.start(steps, 0, 0, time.Time{})
	}
	step := steps[idx]
	if r := p.in.Observed.Result; r != nil && r.OperationID == op.GetId() && op.GetState() == OpRunning {
		if failed, ok := p.record(op, r); ok {
			return failed
		}
	}
	switch op.GetState() {
	case OpSucceeded:
		return p.advance(steps, idx, done, doneMsg)
	case OpFailed:
		if op.GetRetryAfter() != nil && p.in.Now.Before(op.GetRetryAfter().AsTime()) {
			return p.wait(op.GetRetryAfter().AsTime().Sub(p.in.Now))
		}
		from := idx
		if isTimedOut(op) && step.retryFrom != "" {
			if step.name == StepLayImage {
				// The retry's power off ends the agent's journal: ask it
				// first whether the lay ended after all (a slow agent, a
				// result the controller did not see in time).
				r := p.in.Observed.Result
				if r == nil || r.OperationID != op.GetId() {
					return actionRun{
						actions:  []Action{{Kind: ActReattach, OperationID: op.GetId()}},
						deadline: min(p.in.Config.timeout(step.name), ReattachTimeout),
					}
				}
				if r.Err == "" {
					p.lateSuccess(op)
					return p.advance(steps, idx, done, doneMsg)
				}
			}
			from = indexOf(steps, step.retryFrom)
		}
		return p.start(steps, from, op.GetAttempt(), time.Time{})
	default: // Running
		timeout := p.in.Config.timeout(step.name)
		elapsed := p.in.Now.Sub(op.GetStarted().AsTime())
		if step.wait != nil {
			ok, mismatch := step.wait()
			switch {
			case mismatch != "":
				p.failOp(op, ReasonBootSource, mismatch)
				return p.fail(ReasonBootSource, fmt.Sprintf("%s: %s", step.name, mismatch))
			case ok:
				p.bootAgentArrived(step)
				p.succeed(op)
				return p.advance(steps, idx, done, doneMsg)
			case elapsed >= timeout:
				return p.timedOut(op, step, timeout)
			default:
				next := min(p.in.Config.PollInterval, timeout-elapsed)
				if step.name == StepWaitBootAgent {
					if overdue := p.in.Config.ExpectedBoot - elapsed; overdue > 0 {
						next = min(next, overdue)
					} else {
						p.bootAgentMissing(timeout)
					}
				}
				return p.wait(next)
			}
		}
		if elapsed >= timeout {
			// A step past the lay whose agent could not be reached keeps
			// asking it (its retry backoff) until ReattachTimeout past its
			// timeout: timed out, it starts again from PowerOff and the
			// image is laid again, for what may be a moment's refusal (an
			// agent restarting, a link flapping, a controller that just
			// took the host over).
			grace := timeout + ReattachTimeout - elapsed
			if step.pastLay && op.GetReason() == ReasonUnreachable && grace > 0 {
				if ra := op.GetRetryAfter(); ra != nil && p.in.Now.Before(ra.AsTime()) {
					return p.wait(min(ra.AsTime().Sub(p.in.Now), grace))
				}
				return actionRun{actions: step.actions(), deadline: min(grace, ReattachTimeout)}
			}
			if r := p.in.Observed.Result; r == nil || r.OperationID != op.GetId() {
				// Past its timeout with no result seen (a restart, a result
				// lost to a failed status write, a host that waited long in
				// the queue): the actions are idempotent and an agent
				// operation re-attaches by its id, so ask once before giving
				// up. A step after the lay that timed out unasked would be
				// retried from PowerOff and lay the image again.
				return actionRun{actions: step.actions(), deadline: min(timeout, ReattachTimeout)}
			}
			return p.timedOut(op, step, timeout)
		}
		if ra := op.GetRetryAfter(); ra != nil && p.in.Now.Before(ra.AsTime()) {
			return p.wait(min(ra.AsTime().Sub(p.in.Now), timeout-elapsed))
		}
		// Running without a result: the executor that started it is gone
		// (a restart). The actions are idempotent: run them again.
		return actionRun{actions: step.actions(), deadline: timeout - elapsed}
	}
}

func indexOf(steps []stepDef, s Step) int {
	for i, d := range steps {
		if d.name == s {
			return i
		}
	}
	return 0
}

// start writes step i of steps ahead as a Running operation and asks for
// its actions. A wait step inherits started from the step before it.
func (p *planner) start(steps []stepDef, i int, attempt int32, started time.Time) result {
	s := steps[i]
	if started.IsZero() {
		started = p.in.Now
	}
	op := &typesv1.OperationStatus{
		Id:      p.opID(s.name, attempt),
		Kind:    string(s.name),
		State:   OpRunning,
		Started: timestamppb.New(started),
		Attempt: attempt,
	}
	p.st.ProvisioningStep = string(s.name)
	p.st.LastOperation = op
	if p.st.GetState() == typesv1.HostState_HOST_STATE_PROVISIONING {
		p.setProvisioned(conditions.False, ReasonInProgress, "step "+string(s.name))
	}
	if s.wait != nil {
		return p.sequenceWait(s)
	}
	return actionRun{actions: s.actions(), deadline: p.in.Config.timeout(s.name)}
}

// sequenceWait evaluates a freshly started wait step once.
func (p *planner) sequenceWait(s stepDef) result {
	ok, mismatch := s.wait()
	if mismatch != "" || ok {
		// Decided on the next Plan call, with the step stored.
		return actionUpdate{}
	}
	return p.wait(min(p.in.Config.PollInterval, p.in.Config.timeout(s.name)))
}

// advance moves past step idx: to the next step, or to done.
func (p *planner) advance(steps []stepDef, idx int, done typesv1.HostState, doneMsg string) result {
	op := p.st.GetLastOperation()
	switch Step(op.GetKind()) {
	case StepPowerOff, StepPowerOffWiped:
		p.st.Power = "off"
	case StepPowerOn:
		p.st.Power = "on"
	}
	if Step(op.GetKind()) == StepLayImage {
		// Counted once: the write that records the next step is the one
		// that counts, and a restart finds the next step stored.
		p.st.ImageLays++
		p.event("Normal", "ImageLaid", fmt.Sprintf("image %s laid (operation %s)", p.in.Desired.ImageName, op.GetId()))
	}
	if idx+1 < len(steps) {
		var started time.Time
		if steps[idx+1].wait != nil {
			started = op.GetStarted().AsTime()
		}
		return p.start(steps, idx+1, op.GetAttempt(), started)
	}
	p.st.ProvisioningStep = ""
	p.st.LastError = ""
	p.transition(done, doneMsg)
	return actionComplete{}
}

// record folds an executor result into the running operation. It returns
// actionFailed and true when that put the host in Error; otherwise the
// caller decides from the operation as recorded.
func (p *planner) record(op *typesv1.OperationStatus, r *Result) (actionFailed, bool) {
	if r.Err == "" {
		p.succeed(op)
		return actionFailed{}, false
	}
	switch r.Failure {
	case FailPermanent:
		p.failOp(op, ReasonStepFailed, r.Err)
		return p.fail(ReasonStepFailed, fmt.Sprintf("%s: %s", op.GetKind(), r.Err)), true
	case FailTransient:
		p.failOp(op, ReasonTransient, r.Err)
		op.RetryAfter = timestamppb.New(p.in.Now.Add(p.delay(max(r.Consecutive-1, 0))))
	case FailUnreachable:
		op.Error = r.Err
		op.Reason = ReasonUnreachable
		p.st.LastError = fmt.Sprintf("%s: %s", op.GetKind(), r.Err)
		p.event("Warning", ReasonUnreachable, p.st.LastError)
		op.RetryAfter = timestamppb.New(p.in.Now.Add(p.delay(max(r.Consecutive-1, 0))))
	default:
		p.failOp(op, ReasonStepFailed, r.Err)
		if failed, ok := p.countAttempt(op).(actionFailed); ok {
			return failed, true
		}
	}
	return actionFailed{}, false
}

func (p *planner) succeed(op *typesv1.OperationStatus) {
	op.State = OpSucceeded
	op.Error = ""
	op.Reason = ""
	op.RetryAfter = nil
	op.Finished = timestamppb.New(p.in.Now)
	p.finished(op, OutcomeSuccess)
}

// lateSuccess turns op, failed by timing out, into a success: the agent
// said it succeeded after all. Its timeout stays counted (attempt) and
// reported (Finished).
func (p *planner) lateSuccess(op *typesv1.OperationStatus) {
	op.State = OpSucceeded
	op.Error = ""
	op.Reason = ""
	op.RetryAfter = nil
	op.Finished = timestamppb.New(p.in.Now)
	p.st.LastError = ""
	p.event("Normal", ReasonLateSuccess, fmt.Sprintf("%s: operation %s succeeded after the step timed out", op.GetKind(), op.GetId()))
}

// failOp ends op as Failed with reason (stored in op.reason: what the
// retry decision reads) and msg.
func (p *planner) failOp(op *typesv1.OperationStatus, reason, msg string) {
	op.State = OpFailed
	op.Reason = reason
	op.Error = msg
	op.Finished = timestamppb.New(p.in.Now)
	outcome := OutcomeFailure
	if reason == ReasonTimedOut {
		outcome = OutcomeTimeout
	}
	p.finished(op, outcome)
	p.st.LastError = fmt.Sprintf("%s: %s", op.GetKind(), msg)
	p.event("Warning", reason, p.st.LastError)
	if p.st.GetState() == typesv1.HostState_HOST_STATE_PROVISIONING {
		p.setProvisioned(conditions.False, reason, p.st.LastError)
	}
}

// countAttempt counts a failure against MaxAttempts: Error once reached,
// else a backoff before the next try.
func (p *planner) countAttempt(op *typesv1.OperationStatus) result {
	op.Attempt++
	if int(op.Attempt) >= p.in.Config.MaxAttempts {
		return p.fail(ReasonTooManyTries, fmt.Sprintf("%s failed %d times, last: %s", op.GetKind(), op.Attempt, op.GetError()))
	}
	d := p.delay(int(op.Attempt) - 1)
	op.RetryAfter = timestamppb.New(p.in.Now.Add(d))
	return p.wait(d)
}

// bootAgentMissing sets BootAgentCheckedIn=False: the boot agent has not
// checked in ExpectedBoot after the power on. The message says what the
// host was told to boot and what to check; a Warning event goes with it
// once.
func (p *planner) bootAgentMissing(timeout time.Duration) {
	var media string
	switch dev := p.bootDevice(); dev {
	case BootCDROM:
		media = fmt.Sprintf("to boot once from cdrom (virtual media %s)", p.in.ISOURL)
	default:
		media = fmt.Sprintf("to boot once from %s (its iPXE script from the boot server)", dev)
	}
	msg := fmt.Sprintf("no boot agent check-in %s after power on (expected within --expected-boot-time %s; step %s gives up after %s and powers the host off and on again): the host was told %s; check its console: did the firmware boot that device, and can it reach the boot server and the controller?",
		p.in.Config.ExpectedBoot, p.in.Config.ExpectedBoot, StepWaitBootAgent, timeout, media)
	if a := p.st.GetAgent(); a.GetLastHeartbeat() != nil {
		msg += fmt.Sprintf(" Last check-in: the %s agent, booted from %s, at %s.", a.GetMode(), a.GetBootSource(),
			a.GetLastHeartbeat().AsTime().UTC().Format(time.RFC3339))
	}
	c := conditions.New(ConditionBootAgentCheckedIn, conditions.False, ReasonBootAgentMissing, msg)
	c.Severity = "Warning"
	var changed bool
	p.st.Conditions, changed = conditions.Set(p.st.Conditions, c, p.in.Now)
	if changed {
		p.event("Warning", ReasonBootAgentMissing, msg)
	}
}

// bootAgentArrived turns a False BootAgentCheckedIn True when the boot
// agent checks in at last.
func (p *planner) bootAgentArrived(s stepDef) {
	if s.name != StepWaitBootAgent {
		return
	}
	if c := conditions.Get(p.st.GetConditions(), ConditionBootAgentCheckedIn); c == nil || c.GetStatus() == conditions.True {
		return
	}
	a := p.st.GetAgent()
	p.st.Conditions, _ = conditions.Set(p.st.Conditions, conditions.New(ConditionBootAgentCheckedIn, conditions.True, ReasonCheckedIn,
		fmt.Sprintf("the boot agent checked in from %s %s after power on", a.GetBootSource(),
			p.in.Now.Sub(p.st.GetLastOperation().GetStarted().AsTime()).Round(time.Second))), p.in.Now)
}

// legacyMsgTimedOut is how controllers before operation.reason marked a
// timed-out operation (in its message); a host stored by one, waiting out
// the backoff of a timeout during the upgrade, still retries from the
// right step.
const legacyMsgTimedOut = "timed out"

// isTimedOut reports whether op failed by timing out.
func isTimedOut(op *typesv1.OperationStatus) bool {
	if op.GetReason() != "" {
		return op.GetReason() == ReasonTimedOut
	}
	return op.GetMessage() == legacyMsgTimedOut
}

func (p *planner) timedOut(op *typesv1.OperationStatus, s stepDef, timeout time.Duration) result {
	msg := fmt.Sprintf("no result within %s", timeout)
	if s.wait != nil {
		a := p.st.GetAgent()
		msg = fmt.Sprintf("no agent check-in within %s", timeout)
		if a.GetLastHeartbeat() != nil {
			msg += fmt.Sprintf(" (last: the %s agent booted from %s at %s)", a.GetMode(), a.GetBootSource(),
				a.GetLastHeartbeat().AsTime().UTC().Format(time.RFC3339))
		}
	}
	p.failOp(op, ReasonTimedOut, msg)
	return p.countAttempt(op)
}

// delay is the backoff before retry n, with jitter drawn from the host
// name and n so that Plan stays a function of its input.
func (p *planner) delay(n int) time.Duration {
	h := fnv.New64a()
	fmt.Fprintf(h, "%s/%d", p.name, n)
	return p.in.Config.Backoff.Delay(n, rand.New(rand.NewPCG(h.Sum64(), 0)))
}

// opID names a step's operation: the host, the state run (completed lays
// so far), the step and the attempt, and for a lay the image. A restarted
// controller derives the same id and re-attaches; a retry after a failure
// gets a new one.
func (p *planner) opID(s Step, attempt int32) string {
	id := fmt.Sprintf("%s.%s.%d.%s.%d", p.name, strings.ToLower(StateName(p.st.GetState())), p.st.GetImageLays(), strings.ToLower(string(s)), attempt)
	if s == StepLayImage {
		id += "." + p.in.Desired.ImageName
	}
	return id
}

// fail moves the host to Error with reason.
func (p *planner) fail(reason, msg string) actionFailed {
	p.st.ErrorReason = fmt.Sprintf("%s: %s", reason, msg)
	p.st.LastError = msg
	if p.st.GetState() == typesv1.HostState_HOST_STATE_PROVISIONING {
		p.setProvisioned(conditions.False, reason, msg)
	}
	p.st.ErrorGeneration = max(p.in.Host.GetMetadata().GetGeneration(), 1)
	p.transition(typesv1.HostState_HOST_STATE_ERROR, p.st.ErrorReason+" (fix the cause and apply the host again to retry)")
	return actionFailed{reason: reason}
}

func (p *planner) transition(to typesv1.HostState, msg string) {
	if p.st.GetState() == to {
		return
	}
	typ := "Normal"
	if to == typesv1.HostState_HOST_STATE_ERROR {
		typ = "Warning"
	}
	p.st.State = to
	if to != typesv1.HostState_HOST_STATE_ERROR {
		p.st.ErrorReason = ""
	}
	p.st.ProvisioningStep = ""
	p.event(typ, StateName(to), msg)
}

func (p *planner) setProvisioned(status, reason, msg string) {
	p.st.Conditions, _ = conditions.Set(p.st.Conditions, conditions.New(ConditionProvisioned, status, reason, msg), p.in.Now)
}

// finished reports op as ended with outcome.
func (p *planner) finished(op *typesv1.OperationStatus, outcome string) {
	d := time.Duration(0)
	if op.GetStarted() != nil {
		d = max(p.in.Now.Sub(op.GetStarted().AsTime()), 0)
	}
	p.out.Finished = append(p.out.Finished, Finished{Kind: Step(op.GetKind()), Outcome: outcome, Duration: d})
}

// wait looks again after d (at once when d <= 0), or sooner on a change.
func (p *planner) wait(d time.Duration) result { return actionContinue{delay: d} }

func (p *planner) event(typ, reason, msg string) {
	p.out.Events = append(p.out.Events, Event{Type: typ, Reason: reason, Message: msg})
}
