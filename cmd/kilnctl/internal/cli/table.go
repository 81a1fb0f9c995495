package cli

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/cmd/kilnctl/internal/describe"
	"github.com/kilnhq/kiln/internal/conditions"
	opprogress "github.com/kilnhq/kiln/internal/progress"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// column is one column of `kilnctl get` output.
type column struct {
	header string
	wide   bool // only with -o wide
	value  func(r *controllerv1.Resource, now time.Time) string
	// wideValue, when set, replaces value with -o wide.
	wideValue func(r *controllerv1.Resource) string
}

func col(header string, f func(r *controllerv1.Resource) string) column {
	return column{header: header, value: func(r *controllerv1.Resource, _ time.Time) string { return f(r) }}
}

func wideCol(header string, f func(r *controllerv1.Resource) string) column {
	c := col(header, f)
	c.wide = true
	return c
}

var ageCol = column{header: "AGE", value: func(r *controllerv1.Resource, now time.Time) string {
	return age(metaOf(r).GetCreationTimestamp(), now)
}}

func nameCol() column {
	return col("NAME", func(r *controllerv1.Resource) string { return metaOf(r).GetName() })
}

// readyCol shows the Ready condition's status, or "-" when absent.
func readyCol(conds func(r *controllerv1.Resource) []*typesv1.Condition) column {
	return col("READY", func(r *controllerv1.Resource) string {
		if c := conditions.Get(conds(r), "Ready"); c != nil {
			return c.GetStatus()
		}
		return "-"
	})
}

// reasonWidth is how much of a blocking condition's message -o wide
// shows; describe shows it whole.
const reasonWidth = 60

// blocking returns what keeps r from progressing: its most telling
// blocking condition (conditions.Blocking), or nil. For a host without
// one, its error_reason in the Error state stands in.
func blocking(r *controllerv1.Resource) *typesv1.Condition {
	if b := conditions.Blocking(conditionsOf(r)); len(b) > 0 {
		return b[0]
	}
	if h := r.GetHost(); h != nil && h.GetStatus().GetState() == typesv1.HostState_HOST_STATE_ERROR && h.GetStatus().GetErrorReason() != "" {
		return &typesv1.Condition{Type: "Error", Status: conditions.True, Reason: "Error", Message: h.GetStatus().GetErrorReason()}
	}
	return nil
}

// reasonCol is the REASON column: the blocking condition's reason, and
// with -o wide its message too ("ImageNotFound: image x not found; ...").
func reasonCol() column {
	return column{
		header: "REASON",
		value: func(r *controllerv1.Resource, _ time.Time) string {
			c := blocking(r)
			if c == nil {
				return "-"
			}
			return conditions.Summary(&typesv1.Condition{Type: c.GetType(), Status: c.GetStatus(), Reason: c.GetReason()}, 0)
		},
		wideValue: func(r *controllerv1.Resource) string { return dash(conditions.Summary(blocking(r), reasonWidth)) },
	}
}

// wideReasonCol is reasonCol for kinds whose normal table has no room
// for it: only with -o wide.
func wideReasonCol() column {
	c := reasonCol()
	c.wide = true
	return c
}

// columns per kind name.
var columns = map[string][]column{
	"Host": {
		nameCol(),
		col("STATE", func(r *controllerv1.Resource) string { return hostState(r.GetHost().GetStatus().GetState()) }),
		col("POWER", func(r *controllerv1.Resource) string { return dash(r.GetHost().GetStatus().GetPower()) }),
		col("BMC", func(r *controllerv1.Resource) string { return dash(r.GetHost().GetSpec().GetBmc().GetProtocol()) }),
		col("MACHINE", func(r *controllerv1.Resource) string { return dash(r.GetHost().GetStatus().GetMachine()) }),
		col("IMAGE", func(r *controllerv1.Resource) string { return dash(r.GetHost().GetStatus().GetImage()) }),
		col("PROGRESS", func(r *controllerv1.Resource) string { return dash(hostProgress(r.GetHost())) }),
		reasonCol(),
		ageCol,
		wideCol("ADDRESS", func(r *controllerv1.Resource) string { return dash(r.GetHost().GetSpec().GetBmc().GetAddress()) }),
		wideCol("BOOT-MAC", func(r *controllerv1.Resource) string { return dash(r.GetHost().GetSpec().GetBootMac()) }),
		wideCol("AGENT", func(r *controllerv1.Resource) string { return dash(r.GetHost().GetStatus().GetAgent().GetAddress()) }),
		wideCol("STEP", func(r *controllerv1.Resource) string { return dash(r.GetHost().GetStatus().GetProvisioningStep()) }),
		wideCol("LAST-ERROR", func(r *controllerv1.Resource) string { return dash(r.GetHost().GetStatus().GetLastError()) }),
	},
	"Image": {
		nameCol(),
		col("KUBERNETES", func(r *controllerv1.Resource) string { return dash(r.GetImage().GetSpec().GetKubernetesVersion()) }),
		col("OS", func(r *controllerv1.Resource) string { return dash(r.GetImage().GetSpec().GetOs()) }),
		col("FORMAT", func(r *controllerv1.Resource) string { return dash(r.GetImage().GetSpec().GetFormat()) }),
		col("SIZE", func(r *controllerv1.Resource) string { return size(r.GetImage().GetSpec().GetSize()) }),
		ageCol,
		wideCol("SHA256", func(r *controllerv1.Resource) string { return short(r.GetImage().GetSpec().GetSha256(), 12) }),
		wideCol("URL", func(r *controllerv1.Resource) string { return dash(r.GetImage().GetSpec().GetUrl()) }),
	},
	"Cluster": {
		nameCol(),
		col("VERSION", func(r *controllerv1.Resource) string {
			if t := r.GetCluster().GetSpec().GetTopology(); t != nil {
				return dash(t.GetVersion())
			}
			return dash(r.GetCluster().GetSpec().GetKubernetesVersion())
		}),
		col("PHASE", func(r *controllerv1.Resource) string { return dash(r.GetCluster().GetStatus().GetPhase()) }),
		readyCol(func(r *controllerv1.Resource) []*typesv1.Condition { return r.GetCluster().GetStatus().GetConditions() }),
		col("POD-CIDR", func(r *controllerv1.Resource) string { return dash(r.GetCluster().GetSpec().GetPodCidr()) }),
		col("SERVICE-CIDR", func(r *controllerv1.Resource) string { return dash(r.GetCluster().GetSpec().GetServiceCidr()) }),
		ageCol,
		wideCol("ENDPOINT", func(r *controllerv1.Resource) string { return dash(r.GetCluster().GetSpec().GetControlPlaneEndpoint()) }),
		wideCol("API-SERVER", func(r *controllerv1.Resource) string { return dash(r.GetCluster().GetStatus().GetApiServerVersion()) }),
		wideReasonCol(),
	},
	"ControlPlane": {
		nameCol(),
		col("CLUSTER", func(r *controllerv1.Resource) string { return r.GetControlPlane().GetSpec().GetCluster() }),
		col("READY", func(r *controllerv1.Resource) string {
			cp := r.GetControlPlane()
			return fmt.Sprintf("%d/%d", cp.GetStatus().GetReadyReplicas(), cp.GetSpec().GetReplicas())
		}),
		col("UPDATED", func(r *controllerv1.Resource) string {
			return itoa(r.GetControlPlane().GetStatus().GetUpdatedReplicas())
		}),
		col("VERSION", func(r *controllerv1.Resource) string { return dash(r.GetControlPlane().GetSpec().GetVersion()) }),
		ageCol,
		wideCol("IMAGE", func(r *controllerv1.Resource) string {
			x := r.GetControlPlane()
			return imageRef(x.GetSpec().GetImage(), x.GetSpec().GetImageSelector(), x.GetStatus().GetImage())
		}),
		wideCol("ETCD-MEMBERS", func(r *controllerv1.Resource) string { return itoa(r.GetControlPlane().GetStatus().GetEtcdMembers()) }),
		wideReasonCol(),
	},
	"MachineDeployment": {
		nameCol(),
		col("CLUSTER", func(r *controllerv1.Resource) string { return r.GetMachineDeployment().GetSpec().GetCluster() }),
		col("READY", func(r *controllerv1.Resource) string {
			md := r.GetMachineDeployment()
			return fmt.Sprintf("%d/%d", md.GetStatus().GetReadyReplicas(), md.GetSpec().GetReplicas())
		}),
		col("UPDATED", func(r *controllerv1.Resource) string {
			return itoa(r.GetMachineDeployment().GetStatus().GetUpdatedReplicas())
		}),
		col("UNAVAILABLE", func(r *controllerv1.Resource) string {
			return itoa(r.GetMachineDeployment().GetStatus().GetUnavailableReplicas())
		}),
		col("VERSION", func(r *controllerv1.Resource) string { return dash(r.GetMachineDeployment().GetSpec().GetVersion()) }),
		ageCol,
		wideCol("IMAGE", func(r *controllerv1.Resource) string {
			x := r.GetMachineDeployment()
			return imageRef(x.GetSpec().GetImage(), x.GetSpec().GetImageSelector(), x.GetStatus().GetImage())
		}),
		wideCol("STRATEGY", func(r *controllerv1.Resource) string {
			s := r.GetMachineDeployment().GetSpec().GetStrategy()
			if s.GetType() == "OnDelete" {
				return "OnDelete"
			}
			return fmt.Sprintf("RollingUpdate(surge=%s,unavailable=%s)", orDefault(s.GetMaxSurge(), "1"), orDefault(s.GetMaxUnavailable(), "0"))
		}),
		wideReasonCol(),
	},
	"Machine": {
		nameCol(),
		col("CLUSTER", func(r *controllerv1.Resource) string { return r.GetMachine().GetSpec().GetCluster() }),
		col("ROLE", func(r *controllerv1.Resource) string { return dash(r.GetMachine().GetSpec().GetRole()) }),
		col("HOST", func(r *controllerv1.Resource) string { return dash(r.GetMachine().GetSpec().GetHost()) }),
		col("VERSION", func(r *controllerv1.Resource) string { return dash(r.GetMachine().GetSpec().GetVersion()) }),
		col("PHASE", func(r *controllerv1.Resource) string { return dash(r.GetMachine().GetStatus().GetPhase()) }),
		reasonCol(),
		ageCol,
		wideCol("NODE", func(r *controllerv1.Resource) string { return dash(r.GetMachine().GetStatus().GetNodeName()) }),
		wideCol("IMAGE", func(r *controllerv1.Resource) string { return dash(r.GetMachine().GetSpec().GetImage()) }),
		wideCol("OWNER", func(r *controllerv1.Resource) string { return dash(r.GetMachine().GetSpec().GetOwner()) }),
	},
	"HealthCheck": {
		nameCol(),
		col("CLUSTER", func(r *controllerv1.Resource) string { return r.GetHealthCheck().GetSpec().GetCluster() }),
		col("EXPECTED", func(r *controllerv1.Resource) string {
			return itoa(r.GetHealthCheck().GetStatus().GetExpectedMachines())
		}),
		col("HEALTHY", func(r *controllerv1.Resource) string { return itoa(r.GetHealthCheck().GetStatus().GetCurrentHealthy()) }),
		col("MAX-UNHEALTHY", func(r *controllerv1.Resource) string {
			return orDefault(r.GetHealthCheck().GetSpec().GetMaxUnhealthy(), "100%")
		}),
		ageCol,
		wideCol("REMEDIATIONS-ALLOWED", func(r *controllerv1.Resource) string {
			return itoa(r.GetHealthCheck().GetStatus().GetRemediationsAllowed())
		}),
		wideReasonCol(),
	},
	"ClusterClass": {
		nameCol(),
		col("REVISION", func(r *controllerv1.Resource) string {
			return strconv.FormatInt(r.GetClusterClass().GetStatus().GetRevision(), 10)
		}),
		col("CLUSTERS", func(r *controllerv1.Resource) string {
			return strconv.Itoa(int(r.GetClusterClass().GetStatus().GetClusters()))
		}),
		col("UP-TO-DATE", func(r *controllerv1.Resource) string {
			return strconv.Itoa(int(r.GetClusterClass().GetStatus().GetUpToDateClusters()))
		}),
		reasonCol(),
		ageCol,
	},
	"Rollout": {
		nameCol(),
		col("PHASE", func(r *controllerv1.Resource) string { return dash(r.GetRollout().GetStatus().GetPhase()) }),
		col("CHANGE", func(r *controllerv1.Resource) string { return rolloutChange(r.GetRollout().GetSpec().GetChange()) }),
		{header: "WAVES", value: func(r *controllerv1.Resource, now time.Time) string { return waveSummary(r.GetRollout(), now) }},
		reasonCol(),
		ageCol,
	},
	"GitSource": {
		nameCol(),
		col("URL", func(r *controllerv1.Resource) string { return r.GetGitSource().GetSpec().GetUrl() }),
		col("BRANCH", func(r *controllerv1.Resource) string { return dash(r.GetGitSource().GetSpec().GetBranch()) }),
		col("APPLIED", func(r *controllerv1.Resource) string {
			return dash(shortCommit(r.GetGitSource().GetStatus().GetAppliedCommit()))
		}),
		col("OBJECTS", func(r *controllerv1.Resource) string {
			return strconv.Itoa(int(r.GetGitSource().GetStatus().GetAppliedObjects()))
		}),
		col("REFUSED", func(r *controllerv1.Resource) string {
			return dash(shortCommit(r.GetGitSource().GetStatus().GetRefusedCommit()))
		}),
		reasonCol(),
		ageCol,
	},
}

// table writes rows for items of kind k like kubectl: a header and one
// row per item, columns aligned. prefix, when set, is an extra first
// column (the event type in watch).
type table struct {
	w      *tabwriter.Writer
	cols   []column
	wide   bool
	now    func() time.Time
	header bool
}

func newTable(out io.Writer, k kind, wide bool, now func() time.Time) *table {
	var cols []column
	for _, c := range columns[k.Name] {
		if !c.wide || wide {
			cols = append(cols, c)
		}
	}
	return &table{w: tabwriter.NewWriter(out, 0, 8, 3, ' ', 0), cols: cols, wide: wide, now: now}
}

func (t *table) row(prefix []string, r *controllerv1.Resource) {
	if !t.header {
		hs := make([]string, 0, len(prefix)+len(t.cols))
		for range prefix {
			hs = append(hs, "EVENT")
		}
		for _, c := range t.cols {
			hs = append(hs, c.header)
		}
		fmt.Fprintln(t.w, strings.Join(hs, "\t"))
		t.header = true
	}
	vs := append([]string(nil), prefix...)
	now := t.now()
	for _, c := range t.cols {
		if t.wide && c.wideValue != nil {
			vs = append(vs, clean(c.wideValue(r)))
			continue
		}
		vs = append(vs, clean(c.value(r, now)))
	}
	fmt.Fprintln(t.w, strings.Join(vs, "\t"))
}

func (t *table) flush() error { return t.w.Flush() }

// metaOf returns the metadata of whatever r holds.
func metaOf(r *controllerv1.Resource) *typesv1.ObjectMeta {
	switch o := r.GetKind().(type) {
	case *controllerv1.Resource_Host:
		return o.Host.GetMetadata()
	case *controllerv1.Resource_Image:
		return o.Image.GetMetadata()
	case *controllerv1.Resource_Cluster:
		return o.Cluster.GetMetadata()
	case *controllerv1.Resource_ControlPlane:
		return o.ControlPlane.GetMetadata()
	case *controllerv1.Resource_MachineDeployment:
		return o.MachineDeployment.GetMetadata()
	case *controllerv1.Resource_Machine:
		return o.Machine.GetMetadata()
	case *controllerv1.Resource_HealthCheck:
		return o.HealthCheck.GetMetadata()
	case *controllerv1.Resource_ClusterClass:
		return o.ClusterClass.GetMetadata()
	case *controllerv1.Resource_Rollout:
		return o.Rollout.GetMetadata()
	case *controllerv1.Resource_GitSource:
		return o.GitSource.GetMetadata()
	}
	return nil
}

// conditionsOf returns the status conditions of whatever r holds.
func conditionsOf(r *controllerv1.Resource) []*typesv1.Condition {
	switch o := r.GetKind().(type) {
	case *controllerv1.Resource_Host:
		return o.Host.GetStatus().GetConditions()
	case *controllerv1.Resource_Image:
		return o.Image.GetStatus().GetConditions()
	case *controllerv1.Resource_Cluster:
		return o.Cluster.GetStatus().GetConditions()
	case *controllerv1.Resource_ControlPlane:
		return o.ControlPlane.GetStatus().GetConditions()
	case *controllerv1.Resource_MachineDeployment:
		return o.MachineDeployment.GetStatus().GetConditions()
	case *controllerv1.Resource_Machine:
		return o.Machine.GetStatus().GetConditions()
	case *controllerv1.Resource_HealthCheck:
		return o.HealthCheck.GetStatus().GetConditions()
	case *controllerv1.Resource_ClusterClass:
		return o.ClusterClass.GetStatus().GetConditions()
	case *controllerv1.Resource_Rollout:
		return o.Rollout.GetStatus().GetConditions()
	case *controllerv1.Resource_GitSource:
		return o.GitSource.GetStatus().GetConditions()
	}
	return nil
}

// hostProgress is the byte progress of h's running lay or wipe in a
// table cell ("fetch 42% 85.3 MiB/s ETA 20s"), or "" when none runs.
func hostProgress(h *typesv1.Host) string {
	op := h.GetStatus().GetLastOperation()
	if op.GetState() != "Running" {
		return ""
	}
	return opprogress.Short(op.GetProgress())
}

// hostState, age, dash and clean (a cell kept on one line and out of
// the column separators) are the describe package's, under the
// names the commands have always used.
func hostState(st typesv1.HostState) string               { return describe.HostState(st) }
func age(ts *timestamppb.Timestamp, now time.Time) string { return describe.Age(ts, now) }
func dash(s string) string                                { return describe.Dash(s) }
func clean(s string) string                               { return describe.Clean(s) }

func size(b uint64) string {
	if b == 0 {
		return "-"
	}
	const unit = 1024
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	v, i := float64(b), 0
	for v >= unit && i < len(units)-1 {
		v /= unit
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", b)
	}
	return fmt.Sprintf("%.1f %s", v, units[i])
}

func short(s string, n int) string {
	if s == "" {
		return "-"
	}
	if len(s) > n {
		return s[:n]
	}
	return s
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

func itoa(i int32) string { return strconv.Itoa(int(i)) }

// imageRef shows how a ControlPlane or MachineDeployment names its image:
// the name, or the image its selector resolved to with the selector
// ("debian12-k8s1.34.4-20261203 (kubernetes=v1.34.4,os=debian12)").
func imageRef(name string, selector map[string]string, resolved string) string {
	if name != "" || len(selector) == 0 {
		return dash(name)
	}
	return dash(resolved) + " (" + selectorString(selector) + ")"
}

// shortCommit is a commit hash cut to 12 characters, as git log --oneline
// shows them.
func shortCommit(c string) string {
	if len(c) > 12 {
		return c[:12]
	}
	return c
}
