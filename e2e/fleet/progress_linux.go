package fleet

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/kilnhq/kiln/controller/clusterplan"
	"github.com/kilnhq/kiln/internal/conditions"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Snapshot is what the controller says about the lab at one moment.
type Snapshot struct {
	Hosts              map[string]*typesv1.Host
	Machines           map[string]*typesv1.Machine
	ControlPlanes      map[string]*typesv1.ControlPlane
	MachineDeployments map[string]*typesv1.MachineDeployment
	HealthChecks       map[string]*typesv1.HealthCheck
	Cluster            *typesv1.Cluster
}

// Snapshot lists the lab's hosts, the cluster's machines and the cluster.
func (l *Lab) Snapshot(ctx context.Context, cluster string) (*Snapshot, error) {
	res, err := l.Client(ctx)
	if err != nil {
		return nil, err
	}
	s := &Snapshot{Hosts: map[string]*typesv1.Host{}, Machines: map[string]*typesv1.Machine{}}
	hs, err := listAll(ctx, res, "Host")
	if err != nil {
		return nil, err
	}
	for _, r := range hs {
		h := r.GetHost()
		s.Hosts[h.GetMetadata().GetName()] = h
	}
	ms, err := listAll(ctx, res, "Machine")
	if err != nil {
		return nil, err
	}
	for _, r := range ms {
		if m := r.GetMachine(); m.GetSpec().GetCluster() == cluster {
			s.Machines[m.GetMetadata().GetName()] = m
		}
	}
	s.ControlPlanes = map[string]*typesv1.ControlPlane{}
	s.MachineDeployments = map[string]*typesv1.MachineDeployment{}
	s.HealthChecks = map[string]*typesv1.HealthCheck{}
	for _, kind := range []string{"ControlPlane", "MachineDeployment", "HealthCheck"} {
		rs, err := listAll(ctx, res, kind)
		if err != nil {
			return nil, err
		}
		for _, r := range rs {
			switch {
			case r.GetControlPlane().GetSpec().GetCluster() == cluster && r.GetControlPlane() != nil:
				s.ControlPlanes[r.GetControlPlane().GetMetadata().GetName()] = r.GetControlPlane()
			case r.GetMachineDeployment().GetSpec().GetCluster() == cluster && r.GetMachineDeployment() != nil:
				s.MachineDeployments[r.GetMachineDeployment().GetMetadata().GetName()] = r.GetMachineDeployment()
			case r.GetHealthCheck().GetSpec().GetCluster() == cluster && r.GetHealthCheck() != nil:
				s.HealthChecks[r.GetHealthCheck().GetMetadata().GetName()] = r.GetHealthCheck()
			}
		}
	}
	c, err := res.Get(ctx, &controllerv1.GetRequest{Kind: "Cluster", Name: cluster})
	if err == nil {
		s.Cluster = c.GetCluster()
	}
	return s, nil
}

func listAll(ctx context.Context, res controllerv1.ResourcesClient, kind string) ([]*controllerv1.Resource, error) {
	var out []*controllerv1.Resource
	cont := ""
	for {
		r, err := res.List(ctx, &controllerv1.ListRequest{Kind: kind, Limit: 500, Continue: cont})
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", kind, err)
		}
		out = append(out, r.GetItems()...)
		if cont = r.GetContinue(); cont == "" {
			return out, nil
		}
	}
}

// Lines renders the snapshot as one line per host, machine and the
// cluster, for progress output.
func (s *Snapshot) Lines() []string {
	var out []string
	for _, n := range sortedKeys(s.Hosts) {
		h := s.Hosts[n]
		st := strings.TrimPrefix(h.GetStatus().GetState().String(), "HOST_STATE_")
		line := fmt.Sprintf("host %-10s %-14s %s", n, st, h.GetStatus().GetProvisioningStep())
		if m := h.GetStatus().GetMachine(); m != "" {
			line += " machine=" + m
		}
		if e := h.GetStatus().GetLastError(); e != "" {
			line += " last error: " + e
		}
		out = append(out, strings.TrimRight(line, " "))
	}
	for _, n := range sortedKeys(s.Machines) {
		m := s.Machines[n]
		line := fmt.Sprintf("machine %-22s %-8s %-13s host=%s", n, m.GetSpec().GetRole(), m.GetStatus().GetPhase(), m.GetSpec().GetHost())
		for _, t := range []string{clusterplan.MachineNodeReady, clusterplan.MachineClusterDNSResolves} {
			if c := conditions.Get(m.GetStatus().GetConditions(), t); c != nil {
				line += fmt.Sprintf(" %s=%s", t, c.GetStatus())
			}
		}
		out = append(out, line)
	}
	for _, n := range sortedKeys(s.ControlPlanes) {
		st := s.ControlPlanes[n].GetStatus()
		out = append(out, fmt.Sprintf("control plane %s: %d/%d Ready, %d up to date, %d etcd members", n, st.GetReadyReplicas(), s.ControlPlanes[n].GetSpec().GetReplicas(), st.GetUpdatedReplicas(), st.GetEtcdMembers()))
	}
	for _, n := range sortedKeys(s.MachineDeployments) {
		st := s.MachineDeployments[n].GetStatus()
		out = append(out, fmt.Sprintf("deployment %s: %d/%d Ready, %d up to date", n, st.GetReadyReplicas(), s.MachineDeployments[n].GetSpec().GetReplicas(), st.GetUpdatedReplicas()))
	}
	for _, n := range sortedKeys(s.HealthChecks) {
		if c := conditions.Get(s.HealthChecks[n].GetStatus().GetConditions(), clusterplan.ConditionRemediationAllowed); c != nil {
			out = append(out, fmt.Sprintf("health check %s: RemediationAllowed=%s %s", n, c.GetStatus(), c.GetMessage()))
		}
	}
	if c := s.Cluster; c != nil {
		line := fmt.Sprintf("cluster %s %s", c.GetMetadata().GetName(), c.GetStatus().GetPhase())
		if r := conditions.Get(c.GetStatus().GetConditions(), clusterplan.ConditionReady); r != nil {
			line += fmt.Sprintf(": Ready=%s %s", r.GetStatus(), r.GetMessage())
		}
		out = append(out, line)
	}
	return out
}

// Ready reports whether the cluster's Ready condition is True.
func (s *Snapshot) Ready() bool {
	return s.Cluster != nil && conditions.IsTrue(s.Cluster.GetStatus().GetConditions(), clusterplan.ConditionReady)
}

// Watch polls the controller every interval, prints each line that
// changed (with the time since the start), and returns the last snapshot
// once done(snapshot) is true, or an error with the last snapshot's lines
// when ctx ends first.
func (l *Lab) Watch(ctx context.Context, cluster string, interval time.Duration, done func(*Snapshot) bool) (*Snapshot, error) {
	start := time.Now()
	seen := map[string]bool{}
	var last *Snapshot
	for {
		s, err := l.Snapshot(ctx, cluster)
		if err == nil {
			last = s
			for _, line := range s.Lines() {
				if !seen[line] {
					seen[line] = true
					l.say("[%4ds] %s", int(time.Since(start).Seconds()), line)
				}
			}
			if done(s) {
				return s, nil
			}
		} else if ctx.Err() == nil {
			l.say("[%4ds] controller: %v", int(time.Since(start).Seconds()), err)
		}
		select {
		case <-ctx.Done():
			msg := "no answer from the controller"
			if last != nil {
				msg = strings.Join(last.Lines(), "\n  ")
			}
			return last, fmt.Errorf("lab: gave up after %s: %w; last state:\n  %s", time.Since(start).Round(time.Second), ctx.Err(), msg)
		case <-time.After(interval):
		}
	}
}
