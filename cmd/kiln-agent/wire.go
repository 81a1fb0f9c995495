package main

import (
	"context"
	"log/slog"

	"github.com/kilnhq/kiln/agent/journal"
	"github.com/kilnhq/kiln/agent/kubeadm"
	"github.com/kilnhq/kiln/agent/lay"
	"github.com/kilnhq/kiln/agent/metrics"
	"github.com/kilnhq/kiln/agent/personalize"
	"github.com/kilnhq/kiln/agent/preflight"
	"github.com/kilnhq/kiln/agent/prep"
	"github.com/kilnhq/kiln/agent/probe"
	"github.com/kilnhq/kiln/agent/rootdisk"
	"github.com/kilnhq/kiln/agent/server"
	"github.com/kilnhq/kiln/host"
	"github.com/kilnhq/kiln/host/command"
	"github.com/kilnhq/kiln/internal/version"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// services builds the agent API's implementations. Reboot is set by run
// from its flags. fileTargets (--file-targets, the lab) lets images be
// laid into regular files. met (nil: no metrics) is told of lays and
// probes.
func services(root string, fileTargets bool, j *journal.Journal, met *metrics.Metrics, log *slog.Logger) server.Options {
	layOpts := []lay.Option{lay.WithFileTargets(fileTargets)}
	probeOpts := probe.Options{Root: root, Log: log}
	if met != nil {
		layOpts = append(layOpts, lay.WithObserver(met))
		probeOpts.Observer = met
	}
	layer := lay.New(log, layOpts...)
	return server.Options{
		Disks:          &rootdisk.Resolver{Root: root, FileTargets: fileTargets, Log: log},
		Kubeadm:        kubeadm.New(kubeadm.Options{Root: root, Runner: kubeadm.Exec{}, Log: log}),
		Prober:         probe.New(probeOpts),
		Journal:        j,
		Facts:          facter{root: root},
		Preparer:       preparer{p: prep.New(root, command.Exec{}, log)},
		Preflighter:    preflighter{c: preflight.New(root, command.Exec{}, log)},
		ImageLayer:     imageLayer{l: layer},
		Wiper:          wiper{l: layer},
		IdentityWriter: personalize.New(command.Exec{}, log),
		Log:            log,
	}
}

// facter is host.Facts under root, stamped with the agent's version.
type facter struct{ root string }

func (f facter) Facts(ctx context.Context) (*typesv1.Facts, error) {
	facts, err := host.Facts(ctx, f.root)
	if err != nil {
		return nil, err
	}
	facts.AgentVersion = version.Version
	return facts, nil
}

// gatherFacts returns the host's facts for enrollment, or nil (with a
// warning) when they cannot be read: enrollment does not depend on them.
func gatherFacts(ctx context.Context, root string, log *slog.Logger) *typesv1.Facts {
	f, err := facter{root: root}.Facts(ctx)
	if err != nil {
		log.Warn("could not gather facts; enrolling without them", "error", err)
		return nil
	}
	return f
}

type preparer struct{ p *prep.Preparer }

func (p preparer) Prepare(ctx context.Context, req *agentv1.PrepareRequest, emit server.Emit) (*agentv1.PrepareResult, error) {
	return p.p.Prepare(ctx, req, func(msg string) {
		emit(&agentv1.OperationEvent{Message: msg})
	})
}

type preflighter struct{ c *preflight.Checker }

func (p preflighter) Preflight(ctx context.Context, req *agentv1.PreflightRequest) (*agentv1.PreflightReport, error) {
	return p.c.Run(ctx, req.GetCluster())
}

type imageLayer struct{ l *lay.Layer }

func (l imageLayer) LayImage(ctx context.Context, req *agentv1.LayImageRequest, emit server.Emit) (*agentv1.LayImageResult, error) {
	return l.l.Lay(ctx, req, progressTo(emit))
}

type wiper struct{ l *lay.Layer }

func (w wiper) Wipe(ctx context.Context, req *agentv1.WipeRequest, emit server.Emit) error {
	return w.l.Wipe(ctx, req.GetTarget(), progressTo(emit))
}

func progressTo(emit server.Emit) func(*agentv1.Progress) {
	return func(p *agentv1.Progress) {
		emit(&agentv1.OperationEvent{Message: p.GetStep(), Progress: p})
	}
}

var (
	_ server.DiskResolver = (*rootdisk.Resolver)(nil)
	_ server.Kubeadm      = (*kubeadm.Kubeadm)(nil)
	_ server.Prober       = (*probe.Prober)(nil)
	_ lay.Observer        = (*metrics.Metrics)(nil)
	_ probe.Observer      = (*metrics.Metrics)(nil)
)
