package gitplan

import (
	"flag"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kilnhq/kiln/controller/resources"
	"github.com/kilnhq/kiln/internal/conditions"
	"github.com/kilnhq/kiln/internal/transcript"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

var update = flag.Bool("update", false, "rewrite testdata/*.txt with the actual output")

// t0 is the transcripts' time origin; "at 90s" means t0+90s.
var t0 = time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC)

// TestTranscripts replays testdata/*.txt. Commands:
//
//	source name=N [generation=G] [interval=D]   the GitSource
//	owned kind/name ...                 objects labelled as this source's
//	other kind/name=SOURCE ...          objects labelled as another source's
//	revision commit=C kind/name[{label=value}] ...   a fetched commit
//	problems commit=C TEXT              a fetched commit whose files are bad
//	plan                                plan the revision and print it
//	outcome applied|refused|fetch-failed|apply-failed [TEXT]
//	                                    record an outcome of the revision
//	                                    (applied: the plan's objects)
//	at D                                move the clock to t0+D
//	due                                 print whether a fetch is due
//
// Run with -update to rewrite the files, then review the diff.
func TestTranscripts(t *testing.T) {
	transcript.Run(t, "testdata/*.txt", *update, func(t *testing.T) transcript.Exec {
		r := &runner{now: t0, src: &typesv1.GitSource{Metadata: &typesv1.ObjectMeta{Name: "fleet", Generation: 1}, Spec: &typesv1.GitSourceSpec{}}}
		return r.exec
	})
}

type runner struct {
	now  time.Time
	src  *typesv1.GitSource
	rev  Revision
	obs  Observed
	plan Plan
}

func args(fields []string) map[string]string {
	out := map[string]string{}
	for _, f := range fields {
		if k, v, ok := strings.Cut(f, "="); ok {
			out[k] = v
		}
	}
	return out
}

func ref(t *testing.T, s string) resources.Ref {
	kind, name, ok := strings.Cut(s, "/")
	require.True(t, ok, "object %q: want kind/name", s)
	k, err := resources.LookupKind(kind)
	require.NoError(t, err)
	return resources.Ref{Kind: k.Plural, Name: name}
}

func (r *runner) exec(t *testing.T, cmd string) string {
	fields := strings.Fields(cmd)
	switch fields[0] {
	case "source":
		a := args(fields[1:])
		if v, ok := a["name"]; ok {
			r.src.Metadata.Name = v
		}
		if v, ok := a["generation"]; ok {
			g, err := strconv.ParseInt(v, 10, 64)
			require.NoError(t, err)
			r.src.Metadata.Generation = g
		}
		if v, ok := a["interval"]; ok {
			r.src.Spec.Interval = v
		}
		return ""
	case "owned":
		r.obs.Owned = nil
		for _, f := range fields[1:] {
			r.obs.Owned = append(r.obs.Owned, ref(t, f))
		}
		return ""
	case "other":
		r.obs.OwnedBy = map[resources.Ref]string{}
		for _, f := range fields[1:] {
			obj, src, _ := strings.Cut(f, "=")
			r.obs.OwnedBy[ref(t, obj)] = src
		}
		return ""
	case "revision":
		r.rev = Revision{Commit: args(fields[1:2])["commit"]}
		for _, f := range fields[2:] {
			obj, label, _ := strings.Cut(strings.TrimSuffix(f, "}"), "{")
			rf := ref(t, obj)
			k, _ := resources.LookupKind(rf.Kind)
			m := k.New()
			md := &typesv1.ObjectMeta{Name: rf.Name}
			if lk, lv, ok := strings.Cut(label, "="); ok {
				md.Labels = map[string]string{lk: lv}
			}
			m.ProtoReflect().Set(m.ProtoReflect().Descriptor().Fields().ByName("metadata"), valueOf(md))
			r.rev.Objects = append(r.rev.Objects, Object{File: rf.Kind + "/" + rf.Name + ".yaml", Resource: k.Wrap(m)})
		}
		return ""
	case "problems":
		r.rev = Revision{Commit: args(fields[1:2])["commit"], Problems: strings.Join(fields[2:], " ")}
		return ""
	case "plan":
		r.plan = PlanRevision(r.src.GetMetadata().GetName(), r.rev, r.obs)
		return formatPlan(r.plan)
	case "outcome":
		out := Outcome{Commit: r.rev.Commit}
		text := strings.Join(fields[2:], " ")
		switch fields[1] {
		case "applied":
			out.Objects = len(r.plan.Apply)
			// What the executor's transaction did: the source now owns
			// what it applied.
			r.obs.Owned = nil
			for _, a := range r.plan.Apply {
				k, obj, err := resources.Unwrap(a)
				require.NoError(t, err)
				r.obs.Owned = append(r.obs.Owned, resources.Ref{Kind: k.Plural, Name: resources.Meta(obj).GetName()})
			}
		case "refused":
			out.Refused = text
			if text == "" {
				out.Refused = r.plan.Refused
			}
		case "fetch-failed":
			out.Commit, out.FetchError = "", text
		case "apply-failed":
			out.ApplyError = text
		default:
			t.Fatalf("outcome %q", fields[1])
		}
		st, changed := Status(r.src, out, r.now)
		r.src.Status = st
		return formatStatus(st, changed)
	case "at":
		d, err := time.ParseDuration(fields[1])
		require.NoError(t, err)
		r.now = t0.Add(d)
		return ""
	case "due":
		return fmt.Sprintf("due=%v\n", Due(r.src, r.now))
	}
	t.Fatalf("unknown command %q", cmd)
	return ""
}

func formatPlan(p Plan) string {
	if p.Refused != "" {
		return "refused: " + p.Refused + "\n"
	}
	var b strings.Builder
	for i, a := range p.Apply {
		k, obj, _ := resources.Unwrap(a)
		labels := resources.Meta(obj).GetLabels()
		var ls []string
		for k, v := range labels {
			ls = append(ls, k+"="+v)
		}
		sort.Strings(ls)
		fmt.Fprintf(&b, "apply %s/%s from %s labels %s\n", strings.ToLower(k.Name), resources.Meta(obj).GetName(), p.Files[i], strings.Join(ls, ","))
	}
	for _, r := range p.Prune {
		fmt.Fprintf(&b, "prune %s\n", r)
	}
	if b.Len() == 0 {
		return "nothing\n"
	}
	return b.String()
}

func formatStatus(st *typesv1.GitSourceStatus, changed bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "applied=%q", st.GetAppliedCommit())
	if st.GetAppliedTime() != nil {
		fmt.Fprintf(&b, " at=%s", st.GetAppliedTime().AsTime().Sub(t0))
	}
	fmt.Fprintf(&b, " objects=%d", st.GetAppliedObjects())
	if st.GetRefusedCommit() != "" {
		fmt.Fprintf(&b, " refused=%q", st.GetRefusedCommit())
	}
	fmt.Fprintf(&b, " fetched=%s changed=%v\n", st.GetLastFetchTime().AsTime().Sub(t0), changed)
	c := conditions.Get(st.GetConditions(), Ready)
	fmt.Fprintf(&b, "Ready=%s %s: %s\n", c.GetStatus(), c.GetReason(), c.GetMessage())
	return b.String()
}

func valueOf(md *typesv1.ObjectMeta) protoreflect.Value {
	return protoreflect.ValueOfMessage(md.ProtoReflect())
}
