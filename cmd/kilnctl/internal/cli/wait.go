package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/stall"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// waitResync is how often wait reads the resource again besides
// watching it: a change made just as the watch starts may not reach it.
const waitResync = 5 * time.Second

// waitRetry is how long wait pauses before watching again after the
// controller went away (a restart, another replica taking over).
const waitRetry = time.Second

const forForm = "use --for condition=TYPE or --for condition=TYPE=STATUS (STATUS True, False or Unknown; default True), e.g. --for condition=Ready"

// ErrStalled is the class of the error of a wait that stopped because
// nothing changed for --stall-timeout; kilnctl exits 3 on it (ExitCode).
var ErrStalled = errors.New("stalled")

// ExitCode is kilnctl's exit status for the error Run returned: 0 for
// nil, 3 for a stalled wait (ErrStalled), 1 for files that differ
// (ErrDiffers), 2 for an error of kilnctl diff, 1 for anything else (a
// timed out wait among them).
func ExitCode(err error) int {
	var ee *exitError
	switch {
	case err == nil:
		return 0
	case errors.Is(err, ErrStalled):
		return 3
	case errors.As(err, &ee):
		return ee.code
	}
	return 1
}

func (a *app) waitCommand() *cobra.Command {
	var forFlag string
	var timeout, stallTimeout time.Duration
	cmd := &cobra.Command{
		Use:   "wait KIND/NAME --for condition=TYPE[=STATUS] [--timeout D] [--stall-timeout D]",
		Short: "Wait until a resource's condition has a status",
		Long: `Wait until a condition of a resource has a status (True unless given),
like kubectl wait. wait watches the resource and prints a line to standard
error whenever its state or phase or its conditions change; when the
condition holds it prints "KIND/NAME condition TYPE=STATUS met" and exits
0. It exits 1, printing the last conditions with their reasons and
messages, when --timeout passes or the resource is deleted. --timeout 0
waits without limit. A controller that restarts is watched again.

--stall-timeout D stops the wait early when nothing has changed for D:
no resource version changed among the resource and what it is made of
(a cluster's control planes, machine deployments, health checks,
machines and their hosts; a control plane's or deployment's machines and
their hosts; a machine's host). It then prints every blocking condition
of those objects (KIND/NAME: TYPE=STATUS REASON: MESSAGE) and exits 3.
A timeout exits 1.`,
		Example: `  kilnctl wait cluster/lab --for condition=Ready --timeout 30m --stall-timeout 5m
  kilnctl wait host/h1 --for condition=Provisioned
  kilnctl wait machine/lab-cp-x7k2 --for condition=BootstrapFailed=False`,
		Args: cobra.RangeArgs(1, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			target := args[0]
			if len(args) == 2 {
				if strings.Contains(target, "/") {
					return errdefs.InvalidArgument("wait: %q %q: name the resource as KIND/NAME or KIND NAME, e.g. cluster/lab or cluster lab", args[0], args[1])
				}
				target += "/" + args[1]
			}
			k, name, err := parseWaitTarget(target)
			if err != nil {
				return err
			}
			cond, want, err := parseWaitFor(forFlag)
			if err != nil {
				return err
			}
			if timeout < 0 {
				return errdefs.InvalidArgument("wait: --timeout %v: use a positive duration such as 30s or 30m, or 0 to wait without limit", timeout)
			}
			if stallTimeout < 0 {
				return errdefs.InvalidArgument("wait: --stall-timeout %v: use a positive duration such as 5m, or 0 not to stop early", stallTimeout)
			}
			c, err := a.client(cmd.Context())
			if err != nil {
				return err
			}
			w := &waiter{
				a: a, c: c, k: k, name: name, cond: cond, want: want, timeout: timeout,
				stderr: cmd.ErrOrStderr(), now: a.opts.Now,
			}
			if stallTimeout > 0 {
				w.stall = stall.New(stallTimeout)
				w.stallPoll = min(waitResync, max(stallTimeout/5, 50*time.Millisecond))
			}
			return w.run(cmd.Context(), cmd.OutOrStdout())
		},
	}
	cmd.Flags().StringVar(&forFlag, "for", "", "the condition to wait for: condition=TYPE[=STATUS]")
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "give up after this long (0: no limit)")
	cmd.Flags().DurationVar(&stallTimeout, "stall-timeout", 0, "stop (exit 3) when nothing in the resource's scope has changed for this long, printing what blocks it (0: never)")
	return cmd
}

// parseWaitTarget reads KIND/NAME.
func parseWaitTarget(s string) (kind, string, error) {
	ks, name, ok := strings.Cut(s, "/")
	if !ok || ks == "" || name == "" || strings.Contains(name, "/") {
		return kind{}, "", errdefs.InvalidArgument("wait: %q: name the resource as KIND/NAME, e.g. cluster/lab or host/h1", s)
	}
	k, err := lookupKind(ks)
	if err != nil {
		return kind{}, "", err
	}
	return k, name, nil
}

// parseWaitFor reads condition=TYPE[=STATUS]; STATUS is True, False or
// Unknown in any case and defaults to True.
func parseWaitFor(s string) (cond, status string, err error) {
	if s == "" {
		return "", "", errdefs.InvalidArgument("wait: --for is required: %s", forForm)
	}
	rest, ok := strings.CutPrefix(s, "condition=")
	if !ok {
		return "", "", errdefs.InvalidArgument("wait: --for %q: %s", s, forForm)
	}
	cond, status, hasStatus := strings.Cut(rest, "=")
	if cond == "" || strings.ContainsAny(cond, " \t=") {
		return "", "", errdefs.InvalidArgument("wait: --for %q: %s", s, forForm)
	}
	if !hasStatus {
		return cond, "True", nil
	}
	for _, st := range []string{"True", "False", "Unknown"} {
		if strings.EqualFold(status, st) {
			return cond, st, nil
		}
	}
	return "", "", errdefs.InvalidArgument("wait: --for %q: status %q: %s", s, status, forForm)
}

// waiter is one kilnctl wait.
type waiter struct {
	a       *app
	c       controllerv1.ResourcesClient
	k       kind
	name    string
	cond    string
	want    string
	timeout time.Duration
	stderr  io.Writer

	last    *controllerv1.Resource // last seen
	printed string                 // the last progress line
	lastErr error                  // why the watch is broken; nil while it works

	// stall, when set, ends the wait once nothing in the resource's
	// scope changed for its timeout; the scope is read every stallPoll.
	stall     *stall.Detector
	stallPoll time.Duration
	now       func() time.Time
}

// stalledError is the cause of a wait's end by the stall detector.
type stalledError struct {
	since   time.Time // the last change seen
	objects int       // how many objects the scope held
	blocked []string  // stall.Blocked of the scope
}

func (e *stalledError) Error() string { return "stalled" }
func (e *stalledError) Unwrap() error { return ErrStalled }

// errWaitDeleted ends a wait whose resource was deleted.
var errWaitDeleted = errors.New("deleted")

func (w *waiter) target() string { return w.k.lower() + "/" + w.name }

func (w *waiter) run(parent context.Context, stdout io.Writer) error {
	timed, cancel := context.WithCancel(parent)
	if w.timeout > 0 {
		timed, cancel = context.WithTimeout(parent, w.timeout)
	}
	defer cancel()
	ctx, stop := context.WithCancelCause(timed)
	defer stop(nil)
	if w.stall != nil {
		go w.watchProgress(ctx, stop)
	}
	for {
		met, err := w.watch(ctx)
		if met {
			fmt.Fprintf(stdout, "%s condition %s=%s met\n", w.target(), w.cond, w.want)
			return nil
		}
		var stalled *stalledError
		switch {
		case errors.Is(err, errWaitDeleted):
			return errdefs.NotFound("wait %s: %s %s was deleted while waiting for %s=%s%s", w.target(), w.k.lower(), w.name, w.cond, w.want, w.lastConditions())
		case parent.Err() != nil:
			return fmt.Errorf("wait %s: interrupted while waiting for %s=%s%s: %w", w.target(), w.cond, w.want, w.lastConditions(), parent.Err())
		case errors.As(context.Cause(ctx), &stalled):
			return w.stalledErr(stalled)
		case ctx.Err() != nil || w.pastDeadline(ctx):
			why := ""
			if w.lastErr != nil {
				why = " (" + w.lastErr.Error() + ")"
			}
			return fmt.Errorf("wait %s: timed out after %v waiting for %s=%s%s%s: %w", w.target(), w.timeout, w.cond, w.want, why, w.lastConditions(), errdefs.ErrDeadlineExceeded)
		case errdefs.IsUnavailable(err):
			// The controller went away: watch again once it is back,
			// saying so once per distinct reason.
			if w.lastErr == nil || w.lastErr.Error() != err.Error() {
				fmt.Fprintf(w.stderr, "%s: lost the watch (%v); watching again\n", w.target(), err)
			}
			w.lastErr = err
			select {
			case <-ctx.Done():
			case <-time.After(waitRetry):
			}
		default:
			return w.a.rpcError("wait "+w.target(), err)
		}
	}
}

// watchProgress reads the wait's scope (stall.Scope) every stallPoll and
// feeds its resource versions to the stall detector; when the detector
// says nothing changed for its timeout it ends the wait with a
// *stalledError. A read that fails is skipped: an unreachable controller
// shows no progress either, and the watch reports it.
func (w *waiter) watchProgress(ctx context.Context, stop context.CancelCauseFunc) {
	t := time.NewTicker(w.stallPoll)
	defer t.Stop()
	for {
		if scope, err := w.scope(ctx); err == nil && w.stall.Observe(w.now(), stall.Versions(scope)) {
			stop(&stalledError{since: w.stall.LastChange(), objects: len(scope), blocked: stall.Blocked(scope)})
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// scope lists the objects whose progress is the wait's progress.
func (w *waiter) scope(ctx context.Context) ([]*controllerv1.Resource, error) {
	var items []*controllerv1.Resource
	for _, kind := range stall.ScopeKinds(w.k.Name) {
		if kind == w.k.Name && len(stall.ScopeKinds(kind)) == 1 {
			cctx, cancel := w.a.call(ctx)
			r, err := w.c.Get(cctx, &controllerv1.GetRequest{Kind: kind, Name: w.name})
			cancel()
			if err != nil {
				return nil, err
			}
			items = append(items, r)
			continue
		}
		rs, err := w.a.listAll(ctx, w.c, kind)
		if err != nil {
			return nil, err
		}
		items = append(items, rs...)
	}
	return stall.Scope(w.k.Name, w.name, items), nil
}

// stalledErr says the wait stalled, what was watched and what blocks.
func (w *waiter) stalledErr(s *stalledError) error {
	what := w.target()
	switch s.objects {
	case 0, 1:
	case 2:
		what = w.target() + " and the object it is made of"
	default:
		what = fmt.Sprintf("%s and the %d objects it is made of", w.target(), s.objects-1)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "wait %s: nothing changed in %s for %v (since %s) while waiting for %s=%s", w.target(), what,
		w.stall.Timeout(), s.since.UTC().Format(time.RFC3339), w.cond, w.want)
	if len(s.blocked) == 0 {
		b.WriteString("; none of them has a blocking condition")
	} else {
		b.WriteString("; blocked by:")
		for _, l := range s.blocked {
			b.WriteString("\n  " + l)
		}
	}
	fmt.Fprintf(&b, "\nhint: kilnctl describe %s %s shows every condition and the recent events", w.k.lower(), w.name)
	return stalledMsg(b.String())
}

// stalledMsg is the error of a stalled wait: of class ErrStalled,
// without repeating it in the message.
type stalledMsg string

func (e stalledMsg) Error() string { return string(e) }
func (e stalledMsg) Unwrap() error { return ErrStalled }

// pastDeadline reports whether ctx's deadline has passed even though
// ctx may not say so yet: the controller enforces the same deadline on
// the watch and its cancellation can arrive first.
func (w *waiter) pastDeadline(ctx context.Context) bool {
	d, ok := ctx.Deadline()
	return ok && !time.Now().Before(d)
}

// watch watches the resource until the condition holds (true), it is
// deleted (errWaitDeleted), ctx ends or the watch breaks.
func (w *waiter) watch(ctx context.Context) (bool, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := w.c.Watch(ctx, &controllerv1.WatchRequest{Kind: w.k.Name, Name: w.name})
	if err != nil {
		return false, errgrpc.FromGRPC(err)
	}
	// The controller sends headers once it accepted the watch; reading
	// the resource after that misses no change but one made while the
	// controller starts its own watch, which the resync catches.
	if _, err := stream.Header(); err != nil {
		return false, errgrpc.FromGRPC(err)
	}
	if met, err := w.get(ctx); met || err != nil {
		return met, err
	}
	w.lastErr = nil
	events := make(chan *controllerv1.WatchEvent)
	broke := make(chan error, 1)
	go func() {
		for {
			ev, err := stream.Recv()
			if err != nil {
				if errors.Is(err, io.EOF) {
					err = errdefs.Unavailable("the controller ended the watch")
				}
				broke <- errgrpc.FromGRPC(err)
				return
			}
			select {
			case events <- ev:
			case <-ctx.Done():
				return
			}
		}
	}()
	resync := time.NewTicker(waitResync)
	defer resync.Stop()
	for {
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case err := <-broke:
			return false, err
		case ev := <-events:
			if ev.GetType() == "DELETED" {
				return false, errWaitDeleted
			}
			if w.observe(ev.GetResource()) {
				return true, nil
			}
		case <-resync.C:
			if met, err := w.get(ctx); met || err != nil {
				return met, err
			}
		}
	}
}

// get reads the resource and observes it. NotFound after the resource
// was seen means it was deleted.
func (w *waiter) get(ctx context.Context) (bool, error) {
	cctx, cancel := w.a.call(ctx)
	defer cancel()
	r, err := w.c.Get(cctx, &controllerv1.GetRequest{Kind: w.k.Name, Name: w.name})
	if err != nil {
		e := errgrpc.FromGRPC(err)
		if errdefs.IsNotFound(e) && w.last != nil {
			return false, errWaitDeleted
		}
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		return false, e
	}
	return w.observe(r), nil
}

// observe records r, prints a progress line when its state or conditions
// changed and reports whether the condition holds.
func (w *waiter) observe(r *controllerv1.Resource) bool {
	w.last = r
	line := w.target() + ": " + progress(r)
	if line != w.printed {
		fmt.Fprintln(w.stderr, line)
		w.printed = line
	}
	c := findCondition(r, w.cond)
	return c != nil && strings.EqualFold(c.GetStatus(), w.want)
}

// progress is one line of a resource's state or phase and conditions:
// "state Provisioning; BMCReachable=True, Provisioned=False (Laying)".
func progress(r *controllerv1.Resource) string {
	var parts []string
	if s := stateOf(r); s != "" {
		parts = append(parts, s)
	}
	conds := conditionsOf(r)
	if len(conds) == 0 {
		parts = append(parts, "no conditions")
	} else {
		var cs []string
		for _, c := range conds {
			s := c.GetType() + "=" + c.GetStatus()
			if c.GetReason() != "" {
				s += " (" + c.GetReason() + ")"
			}
			cs = append(cs, s)
		}
		parts = append(parts, strings.Join(cs, ", "))
	}
	return strings.Join(parts, "; ")
}

// stateOf is the state, phase or replica count of r, "" for kinds that
// have none.
func stateOf(r *controllerv1.Resource) string {
	switch o := r.GetKind().(type) {
	case *controllerv1.Resource_Host:
		st := o.Host.GetStatus()
		s := "state " + hostState(st.GetState())
		if st.GetProvisioningStep() != "" {
			s += " (" + st.GetProvisioningStep() + ")"
		}
		return s
	case *controllerv1.Resource_Cluster:
		return "phase " + dash(o.Cluster.GetStatus().GetPhase())
	case *controllerv1.Resource_Machine:
		return "phase " + dash(o.Machine.GetStatus().GetPhase())
	case *controllerv1.Resource_ControlPlane:
		return fmt.Sprintf("ready %d/%d", o.ControlPlane.GetStatus().GetReadyReplicas(), o.ControlPlane.GetSpec().GetReplicas())
	case *controllerv1.Resource_MachineDeployment:
		return fmt.Sprintf("ready %d/%d", o.MachineDeployment.GetStatus().GetReadyReplicas(), o.MachineDeployment.GetSpec().GetReplicas())
	}
	return ""
}

// lastConditions lists the last seen state and conditions with reasons
// and messages, for errors.
func (w *waiter) lastConditions() string {
	if w.last == nil {
		return "; the resource was never read"
	}
	var b strings.Builder
	if s := stateOf(w.last); s != "" {
		fmt.Fprintf(&b, "; last %s", s)
	}
	conds := conditionsOf(w.last)
	if len(conds) == 0 {
		b.WriteString("; it had no conditions")
		return b.String()
	}
	b.WriteString("; last conditions:")
	for _, c := range conds {
		fmt.Fprintf(&b, "\n  %s=%s", c.GetType(), c.GetStatus())
		if c.GetReason() != "" {
			fmt.Fprintf(&b, " %s", c.GetReason())
		}
		if c.GetMessage() != "" {
			fmt.Fprintf(&b, ": %s", clean(c.GetMessage()))
		}
	}
	return b.String()
}

// findCondition is the condition of type cond (any case) in r; nil when
// r has none.
func findCondition(r *controllerv1.Resource, cond string) *typesv1.Condition {
	for _, c := range conditionsOf(r) {
		if strings.EqualFold(c.GetType(), cond) {
			return c
		}
	}
	return nil
}
