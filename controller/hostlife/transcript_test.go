package hostlife

import (
	"flag"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/transcript"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

var update = flag.Bool("update", false, "rewrite testdata/*.txt with the actual output")

// t0 is the transcripts' time origin; "at=90s" means t0+90s.
var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// TestTranscripts replays testdata/*.txt: blocks of one command, a "----"
// line and the expected output, separated by blank lines. Commands:
//
//	host name=N protocol=redfish|ipmi|none [disk=D] [wwn=W]
//	                                                  a new host, no status;
//	                                                  wwn: rootDeviceHints
//	desire image=I machine=M [missing=true] | desire none
//	                                                  what is wanted; missing:
//	                                                  the image does not exist
//	heartbeat at=D mode=boot|installed source=S [address=none]
//	                                                  an agent checks in
//	bmc status=True|False [reason=R]                  the BMC's condition
//	edit                                              the user changes the
//	                                                  host's spec (generation+1)
//	timeout step=S after=D                            Config.Timeouts[S] = D
//	                                                  (--step-timeout S=D)
//	plan at=D [result=ok|transient|unreachable|agent|perm] [err=E] [consecutive=N]
//	                                                  Plan with the outcome of
//	                                                  the stored operation
//
// A plan without result is what a restarted controller does. Run with
// -update to rewrite the files, then review the diff.
func TestTranscripts(t *testing.T) {
	transcript.Run(t, "testdata/*.txt", *update, func(t *testing.T) transcript.Exec {
		return (&runner{}).exec
	})
}

type runner struct {
	host    *typesv1.Host
	desired Desired
	bmcCond *typesv1.Condition
	cfg     Config
}

func args(t *testing.T, fields []string) map[string]string {
	m := map[string]string{}
	for _, f := range fields {
		k, v, ok := strings.Cut(f, "=")
		require.True(t, ok, "argument %q: want key=value", f)
		m[k] = v
	}
	return m
}

func at(t *testing.T, s string) time.Time {
	d, err := time.ParseDuration(s)
	require.NoError(t, err)
	return t0.Add(d)
}

func (r *runner) exec(t *testing.T, cmd string) string {
	fields := strings.Fields(cmd)
	require.NotEmpty(t, fields)
	if cmd == "edit" {
		r.host.Metadata.Generation++
		return ""
	}
	if cmd == "desire none" {
		r.desired = Desired{}
		return ""
	}
	a := args(t, fields[1:])
	switch fields[0] {
	case "host":
		r.host = &typesv1.Host{
			Metadata: &typesv1.ObjectMeta{Name: a["name"], Generation: 1},
			Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: a["protocol"]}, RootDiskHint: a["disk"]},
		}
		if w := a["wwn"]; w != "" {
			r.host.Spec.RootDeviceHints = &typesv1.RootDeviceHints{Wwn: w}
		}
		return ""
	case "desire":
		r.desired = Desired{Machine: a["machine"], ImageName: a["image"], Image: &typesv1.ImageSpec{Url: "http://images/" + a["image"]}}
		if a["missing"] == "true" {
			r.desired.Image = nil
			r.desired.Blocked = &Blocked{Reason: "ImageNotFound", Message: "machine " + a["machine"] + " names image " + a["image"] + ", which does not exist"}
		}
		return ""
	case "heartbeat":
		if r.host.Status == nil {
			r.host.Status = &typesv1.HostStatus{}
		}
		addr := "10.0.0.1:7444"
		if a["address"] == "none" {
			addr = ""
		}
		r.host.Status.Agent = &typesv1.AgentStatus{
			Address:       addr,
			LastHeartbeat: timestamppb.New(at(t, a["at"])),
			Mode:          a["mode"],
			BootSource:    a["source"],
		}
		return ""
	case "timeout":
		step, err := ParseStep(a["step"])
		require.NoError(t, err)
		d, err := time.ParseDuration(a["after"])
		require.NoError(t, err)
		if r.cfg.Timeouts == nil {
			r.cfg.Timeouts = map[Step]time.Duration{}
		}
		r.cfg.Timeouts[step] = d
		return ""
	case "bmc":
		r.bmcCond = conditions.New("BMCReachable", a["status"], a["reason"], "bmc says "+a["status"])
		return ""
	case "plan":
		in := Input{
			Host:    r.host,
			Desired: r.desired,
			Now:     at(t, a["at"]),
			Config:  r.cfg,
			ISOURL:  "http://boot/iso/" + r.host.GetMetadata().GetName() + ".iso",
			Observed: Observed{
				BMCCondition: r.bmcCond,
			},
		}
		if res, ok := a["result"]; ok {
			rr := &Result{OperationID: r.host.GetStatus().GetLastOperation().GetId(), Err: a["err"]}
			switch res {
			case "ok":
			case "transient":
				rr.Failure = FailTransient
				fmt.Sscan(a["consecutive"], &rr.Consecutive)
			case "agent":
				rr.Failure = FailAgent
			case "unreachable":
				rr.Failure = FailUnreachable
				fmt.Sscan(a["consecutive"], &rr.Consecutive)
			case "perm":
				rr.Failure = FailPermanent
			default:
				t.Fatalf("result=%q: want ok, transient, unreachable, agent or perm", res)
			}
			if res != "ok" && rr.Err == "" {
				rr.Err = "boom"
			}
			in.Observed.Result = rr
		}
		out := Plan(in)
		r.host.Status = out.Status
		return describe(out)
	}
	t.Fatalf("unknown command %q", fields[0])
	return ""
}

func describe(out Output) string {
	var b strings.Builder
	st := out.Status
	fmt.Fprintf(&b, "state=%s step=%s image=%s lays=%d power=%s changed=%t\n", StateName(st.GetState()), st.GetProvisioningStep(), st.GetImage(), st.GetImageLays(), st.GetPower(), out.Changed)
	if op := st.GetLastOperation(); op != nil {
		fmt.Fprintf(&b, "op=%s %s attempt=%d started=%s", op.GetId(), op.GetState(), op.GetAttempt(), rel(op.GetStarted()))
		if op.GetRetryAfter() != nil {
			fmt.Fprintf(&b, " retry_after=%s", rel(op.GetRetryAfter()))
		}
		if op.GetReason() != "" {
			fmt.Fprintf(&b, " reason=%s", op.GetReason())
		}
		b.WriteString("\n")
	}
	if st.GetLastError() != "" {
		fmt.Fprintf(&b, "last_error=%s\n", st.GetLastError())
	}
	if st.GetErrorReason() != "" {
		fmt.Fprintf(&b, "error_reason=%s\n", st.GetErrorReason())
	}
	conds := append([]*typesv1.Condition(nil), st.GetConditions()...)
	sort.Slice(conds, func(i, j int) bool { return conds[i].GetType() < conds[j].GetType() })
	for _, c := range conds {
		fmt.Fprintf(&b, "condition %s=%s reason=%s since=%s\n", c.GetType(), c.GetStatus(), c.GetReason(), rel(c.GetLastTransitionTime()))
	}
	for _, a := range out.Actions {
		fmt.Fprintf(&b, "action %s\n", a)
	}
	switch {
	case len(out.Actions) > 0:
		fmt.Fprintf(&b, "deadline=%s\n", out.Deadline)
	case out.Next == NextAfter:
		fmt.Fprintf(&b, "requeue=%s\n", out.RequeueAfter)
	case out.Next == NextNow:
		b.WriteString("next=now\n")
	}
	if out.Deferrable {
		b.WriteString("deferrable (stored with the next write)\n")
	}
	for _, e := range out.Events {
		fmt.Fprintf(&b, "event %s %s: %s\n", e.Type, e.Reason, e.Message)
	}
	for _, f := range out.Finished {
		fmt.Fprintf(&b, "finished %s %s after %s\n", f.Kind, f.Outcome, f.Duration)
	}
	return b.String()
}

func rel(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return "-"
	}
	return ts.AsTime().Sub(t0).String()
}
