package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/audit"
	"github.com/kilnhq/kiln/controller/limits"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// securityFlags are the flags of the audit log and the limits
// (docs/security.md).
type securityFlags struct {
	auditReaders    []string
	auditMaxAge     time.Duration
	auditMaxEntries int64

	peopleRate, agentRate, anonRate, bootRate string
	streamsPerCaller                          int
	maxMessageBytes                           int
}

func rateString(r limits.Rate) string { return fmt.Sprintf("%g/%d", r.PerSecond, r.Burst) }

func (s *securityFlags) bind(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringSliceVar(&s.auditReaders, "audit-readers", nil, "who may read the audit log besides admins: roles (operator) or ROLE:NAME (reader:alice); repeatable")
	f.DurationVar(&s.auditMaxAge, "audit-max-age", audit.DefaultMaxAge, "audit entries older than this are pruned (-1: keep any age)")
	f.Int64Var(&s.auditMaxEntries, "audit-max-entries", audit.DefaultMaxEntries, "the oldest audit entries beyond this many are pruned (-1: no count limit)")
	f.StringVar(&s.peopleRate, "rate-limit", rateString(limits.DefaultPeople), "API requests per second/burst of each reader, operator or admin certificate (-1: no limit)")
	f.StringVar(&s.agentRate, "rate-limit-agent", rateString(limits.DefaultAgent), "API requests per second/burst of each agent certificate (-1: no limit)")
	f.StringVar(&s.anonRate, "rate-limit-anonymous", rateString(limits.DefaultAnonymous), "API requests per second/burst of each address without a certificate (enrollment; -1: no limit)")
	f.StringVar(&s.bootRate, "rate-limit-boot", rateString(limits.DefaultBoot), "boot server iPXE script and ISO requests per second/burst of each client address (-1: no limit)")
	f.IntVar(&s.streamsPerCaller, "max-streams-per-caller", limits.DefaultStreamsPerCaller, "open watches one caller may hold (-1: no bound)")
	f.IntVar(&s.maxMessageBytes, "max-message-size", limits.DefaultMaxMessageBytes, "largest API request in bytes (an apply's size limit)")
}

// parseRate reads "PER_SECOND/BURST" ("50/200"), or "-1" for no limit.
func parseRate(flag, s string) (limits.Rate, error) {
	if s == "-1" {
		return limits.Rate{PerSecond: -1}, nil
	}
	var r limits.Rate
	if n, err := fmt.Sscanf(s, "%g/%d", &r.PerSecond, &r.Burst); err != nil || n != 2 || r.PerSecond <= 0 || r.Burst < 1 {
		return r, errdefs.InvalidArgument("--%s %q: want PER_SECOND/BURST such as 50/200, or -1 for no limit", flag, s)
	}
	return r, nil
}

func (s *securityFlags) apply(cfg *controller.Config) error {
	cfg.AuditReaders = s.auditReaders
	cfg.AuditMaxAge = s.auditMaxAge
	cfg.AuditMaxEntries = s.auditMaxEntries
	cfg.Limits.StreamsPerCaller = s.streamsPerCaller
	cfg.MaxMessageBytes = s.maxMessageBytes
	for _, r := range []struct {
		flag, val string
		to        *limits.Rate
	}{
		{"rate-limit", s.peopleRate, &cfg.Limits.People},
		{"rate-limit-agent", s.agentRate, &cfg.Limits.Agent},
		{"rate-limit-anonymous", s.anonRate, &cfg.Limits.Anonymous},
		{"rate-limit-boot", s.bootRate, &cfg.BootRate},
	} {
		rate, err := parseRate(r.flag, r.val)
		if err != nil {
			return err
		}
		*r.to = rate
	}
	return nil
}
