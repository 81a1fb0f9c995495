package metrics

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/internal/conditions"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Lister lists a kind from the store (*store.Store).
type Lister interface {
	List(ctx context.Context, kind string, newMsg func() proto.Message, opts store.ListOptions) ([]store.Item, string, error)
}

var _ Lister = (*store.Store)(nil)

// DefaultFleetTimeout bounds the store reads of one scrape.
const DefaultFleetTimeout = 10 * time.Second

// Fleet is a prometheus.Collector that reads hosts, machines, clusters,
// control planes and machine deployments from the store at every scrape
// and reports them as gauges: the store is the truth, so the gauges never
// drift from it and no code path has to remember to update them. A
// scrape's reads are bounded by a timeout; when they fail,
// kiln_fleet_scrape_success is 0 and the fleet gauges are left out of
// that scrape.
type Fleet struct {
	st      Lister
	timeout time.Duration
	log     *slog.Logger

	success, hosts, hostsByPower, hostState, bmcReachable, circuitsOpen, certExpiry,
	machines, machinesByImage, clusters, rollout *prometheus.Desc
}

var _ prometheus.Collector = (*Fleet)(nil)

// NewFleet returns a Fleet reading st, each scrape within timeout
// (DefaultFleetTimeout when <= 0).
func NewFleet(st Lister, timeout time.Duration, log *slog.Logger) *Fleet {
	if timeout <= 0 {
		timeout = DefaultFleetTimeout
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(Namespace, "", name), help, labels, nil)
	}
	return &Fleet{
		st: st, timeout: timeout, log: log.With("component", "metrics"),
		success:         d("fleet_scrape_success", "1 when this scrape read the fleet from the store, 0 when it failed (the fleet gauges are then absent)."),
		hosts:           d("hosts", "Hosts by lifecycle state.", "state"),
		hostsByPower:    d("hosts_by_power", "Hosts by last known power state (on, off, unknown).", "power"),
		hostState:       d("host_state", "1 for each host, labelled with its current lifecycle state and step (one series per host).", "host", "state", "step"),
		bmcReachable:    d("host_bmc_reachable", "1 when the host's BMCReachable condition is True, 0 when False; absent while Unknown or without a BMC (one series per host).", "host", "reason"),
		circuitsOpen:    d("bmc_circuits_open", "Hosts whose BMC circuit breaker is open (BMCReachable False, reason CircuitOpen)."),
		certExpiry:      d("host_agent_certificate_expiry_timestamp_seconds", "When the certificate of the host's enrolled agent expires, in Unix seconds (one series per enrolled host).", "host"),
		machines:        d("machines", "Machines by phase.", "phase"),
		machinesByImage: d("machines_by_image", "Machines by the image they run or are being given, with its Kubernetes version: the version distribution of the fleet.", "image", "kubernetes_version"),
		clusters:        d("clusters", "Clusters by phase and Kubernetes version.", "phase", "kubernetes_version"),
		rollout:         d("rollout_condition", "1 for each condition of each ControlPlane and MachineDeployment (UpToDate, UpgradeAllowed, Available, EtcdQuorum, ...), labelled with its status and reason.", "kind", "name", "condition", "status", "reason"),
	}
}

// Describe implements prometheus.Collector.
func (f *Fleet) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{f.success, f.hosts, f.hostsByPower, f.hostState, f.bmcReachable, f.circuitsOpen,
		f.certExpiry, f.machines, f.machinesByImage, f.clusters, f.rollout} {
		ch <- d
	}
}

// hostStates are the states kiln_hosts always reports, zero or not, so
// that an alert on one of them has a series to look at.
var hostStates = []typesv1.HostState{
	typesv1.HostState_HOST_STATE_REGISTERING, typesv1.HostState_HOST_STATE_INSPECTING,
	typesv1.HostState_HOST_STATE_AVAILABLE, typesv1.HostState_HOST_STATE_PROVISIONING,
	typesv1.HostState_HOST_STATE_PROVISIONED, typesv1.HostState_HOST_STATE_DEPROVISIONING,
	typesv1.HostState_HOST_STATE_WIPING, typesv1.HostState_HOST_STATE_ERROR,
}

// Collect implements prometheus.Collector: it lists the fleet within the
// timeout and sends the gauges.
func (f *Fleet) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), f.timeout)
	defer cancel()
	snap, err := f.read(ctx)
	if err != nil {
		f.log.Warn("fleet metrics: store read failed", "err", err)
		ch <- prometheus.MustNewConstMetric(f.success, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(f.success, prometheus.GaugeValue, 1)
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}

	byState := map[string]float64{}
	for _, s := range hostStates {
		byState[stateName(s)] = 0
	}
	byPower := map[string]float64{"on": 0, "off": 0, "unknown": 0}
	open := 0.0
	for _, h := range snap.hosts {
		name := h.GetMetadata().GetName()
		st := h.GetStatus()
		state := stateName(st.GetState())
		byState[state]++
		power := strings.ToLower(st.GetPower())
		if power != "on" && power != "off" {
			power = "unknown"
		}
		byPower[power]++
		gauge(f.hostState, 1, name, state, st.GetProvisioningStep())
		if c := conditions.Get(st.GetConditions(), "BMCReachable"); c != nil {
			switch c.GetStatus() {
			case conditions.True:
				gauge(f.bmcReachable, 1, name, c.GetReason())
			case conditions.False:
				gauge(f.bmcReachable, 0, name, c.GetReason())
				if c.GetReason() == "CircuitOpen" {
					open++
				}
			}
		}
		if na := st.GetAgent().GetCertificateNotAfter(); na != nil {
			gauge(f.certExpiry, float64(na.AsTime().Unix()), name)
		}
	}
	for k, v := range byState {
		gauge(f.hosts, v, k)
	}
	for k, v := range byPower {
		gauge(f.hostsByPower, v, k)
	}
	gauge(f.circuitsOpen, open)

	byPhase := map[string]float64{}
	type imageKey struct{ image, version string }
	byImage := map[imageKey]float64{}
	for _, m := range snap.machines {
		byPhase[orUnknown(m.GetStatus().GetPhase())]++
		if img := m.GetSpec().GetImage(); img != "" {
			byImage[imageKey{img, m.GetSpec().GetVersion()}]++
		}
	}
	for k, v := range byPhase {
		gauge(f.machines, v, k)
	}
	for k, v := range byImage {
		gauge(f.machinesByImage, v, k.image, k.version)
	}

	type clusterKey struct{ phase, version string }
	byCluster := map[clusterKey]float64{}
	for _, c := range snap.clusters {
		v := c.GetSpec().GetKubernetesVersion()
		if t := c.GetSpec().GetTopology(); t != nil {
			v = t.GetVersion() // a topology cluster's version (docs/clusters.md)
		}
		byCluster[clusterKey{orUnknown(c.GetStatus().GetPhase()), v}]++
	}
	for k, v := range byCluster {
		gauge(f.clusters, v, k.phase, k.version)
	}

	for _, cp := range snap.controlPlanes {
		for _, c := range cp.GetStatus().GetConditions() {
			gauge(f.rollout, 1, "ControlPlane", cp.GetMetadata().GetName(), c.GetType(), c.GetStatus(), c.GetReason())
		}
	}
	for _, md := range snap.deployments {
		for _, c := range md.GetStatus().GetConditions() {
			gauge(f.rollout, 1, "MachineDeployment", md.GetMetadata().GetName(), c.GetType(), c.GetStatus(), c.GetReason())
		}
	}
}

// snapshot is one scrape's read of the store.
type snapshot struct {
	hosts         []*typesv1.Host
	machines      []*typesv1.Machine
	clusters      []*typesv1.Cluster
	controlPlanes []*typesv1.ControlPlane
	deployments   []*typesv1.MachineDeployment
}

func (f *Fleet) read(ctx context.Context) (*snapshot, error) {
	s := &snapshot{}
	if err := listAll(ctx, f.st, "hosts", func() proto.Message { return &typesv1.Host{} }, func(m proto.Message) { s.hosts = append(s.hosts, m.(*typesv1.Host)) }); err != nil {
		return nil, err
	}
	if err := listAll(ctx, f.st, "machines", func() proto.Message { return &typesv1.Machine{} }, func(m proto.Message) { s.machines = append(s.machines, m.(*typesv1.Machine)) }); err != nil {
		return nil, err
	}
	if err := listAll(ctx, f.st, "clusters", func() proto.Message { return &typesv1.Cluster{} }, func(m proto.Message) { s.clusters = append(s.clusters, m.(*typesv1.Cluster)) }); err != nil {
		return nil, err
	}
	if err := listAll(ctx, f.st, "controlplanes", func() proto.Message { return &typesv1.ControlPlane{} }, func(m proto.Message) { s.controlPlanes = append(s.controlPlanes, m.(*typesv1.ControlPlane)) }); err != nil {
		return nil, err
	}
	if err := listAll(ctx, f.st, "machinedeployments", func() proto.Message { return &typesv1.MachineDeployment{} }, func(m proto.Message) { s.deployments = append(s.deployments, m.(*typesv1.MachineDeployment)) }); err != nil {
		return nil, err
	}
	return s, nil
}

// listAll lists kind page by page (the store ends a page at 2 MiB).
func listAll(ctx context.Context, st Lister, kind string, newMsg func() proto.Message, add func(proto.Message)) error {
	cont := ""
	for {
		items, next, err := st.List(ctx, kind, newMsg, store.ListOptions{Limit: 1000, MaxBytes: 2 << 20, Continue: cont})
		if err != nil {
			return err
		}
		for _, it := range items {
			add(it.Msg)
		}
		if next == "" {
			return nil
		}
		cont = next
	}
}

// stateName is hostlife.StateName without importing the planner: the enum
// name after HOST_STATE_, in title case ("Registering").
func stateName(s typesv1.HostState) string {
	n := strings.TrimPrefix(s.String(), "HOST_STATE_")
	if n == "" || n == "UNSPECIFIED" {
		return "Unknown"
	}
	return n[:1] + strings.ToLower(n[1:])
}

func orUnknown(s string) string {
	if s == "" {
		return "Unknown"
	}
	return s
}
