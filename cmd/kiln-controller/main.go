// Command kiln-controller is the Kiln controller daemon: API server, etcd
// store (embedded by default), CA and reconcilers. See docs/controller.md.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/backup"
	"github.com/kilnhq/kiln/controller/datadir"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/operatorcert"
	"github.com/kilnhq/kiln/controller/provision"
	"github.com/kilnhq/kiln/controller/rekey"
	"github.com/kilnhq/kiln/controller/restore"
	"github.com/kilnhq/kiln/controller/store"
	"github.com/kilnhq/kiln/host/systemd"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/version"
)

func main() {
	if err := rootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "kiln-controller:", err)
		os.Exit(1)
	}
}

type common struct {
	dataDir       string
	etcdEndpoints string
	etcdCA        string
	etcdCert      string
	etcdKey       string
	secretKeyFile string
	logLevel      string
}

func (c *common) bind(cmd *cobra.Command) {
	cmd.Flags().StringVar(&c.dataDir, "data-dir", "/var/lib/kiln-controller", "directory of the embedded etcd, the secret key and the admin kilnconfig")
	cmd.Flags().StringVar(&c.etcdEndpoints, "etcd-endpoints", "", "comma-separated client URLs of an external etcd cluster (empty: embedded etcd in --data-dir)")
	cmd.Flags().StringVar(&c.etcdCA, "etcd-cacert", "", "CA certificate (PEM) that signed the external etcd members' certificates, for https:// endpoints (default: the system's roots)")
	cmd.Flags().StringVar(&c.etcdCert, "etcd-cert", "", "client certificate (PEM) the controller presents to an external etcd that requires one (with --etcd-key)")
	cmd.Flags().StringVar(&c.etcdKey, "etcd-key", "", "key (PEM) of --etcd-cert")
	cmd.Flags().StringVar(&c.secretKeyFile, "secret-key-file", "", "AES-256 key sealing secrets at rest (default <data-dir>/secret.key; all replicas must share it)")
	cmd.Flags().StringVar(&c.logLevel, "log-level", "info", "debug, info, warn or error")
}

func (c *common) config() controller.Config {
	cfg := controller.Config{DataDir: c.dataDir, SecretKeyFile: c.secretKeyFile,
		EtcdCAFile: c.etcdCA, EtcdCertFile: c.etcdCert, EtcdKeyFile: c.etcdKey}
	for _, e := range strings.Split(c.etcdEndpoints, ",") {
		if e = strings.TrimSpace(e); e != "" {
			cfg.EtcdEndpoints = append(cfg.EtcdEndpoints, e)
		}
	}
	return cfg
}

// state names the controller's state for the commands that work on it
// from outside (controller/datadir).
func (c *common) state() datadir.Config {
	cfg := c.config()
	return datadir.Config{DataDir: cfg.DataDir, SecretKeyFile: cfg.SecretKeyFile, EtcdEndpoints: cfg.EtcdEndpoints,
		EtcdCAFile: cfg.EtcdCAFile, EtcdCertFile: cfg.EtcdCertFile, EtcdKeyFile: cfg.EtcdKeyFile}
}

func (c *common) logger(w io.Writer) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(c.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level %q: %w", c.logLevel, err)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: lvl})), nil
}

func rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "kiln-controller",
		Short:         "Kiln controller: API, store, CA and reconcilers",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(runCmd(), operatorCertCmd(), restoreCmd(), rotateSecretKeyCmd(), rotateCACmd(), versionCmd())
	return root
}

func runCmd() *cobra.Command {
	var (
		c           common
		listen      string
		id          string
		serverNames []string
		reserved    []string
		gitRoots    []string
		electionTTL time.Duration
		heartbeat   time.Duration
		silence     time.Duration
		lifecycle   bool
		apiOnly     bool
		bootURL     string
		ctlURL      string
		simulate    int
		shards      int
		metricsAddr string
		boot        bootFlags
		security    securityFlags
	)
	var expectedBoot time.Duration
	var maxInFlight int
	var compaction store.Compaction
	var quota int64
	var exec execFlags
	var stepTimeouts stepTimeoutFlags
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Run the controller",
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := c.logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			cfg := c.config()
			cfg.ListenAddr = listen
			cfg.ID = id
			cfg.ServerNames = serverNames
			if cfg.ReservedNetworks, err = parseNetworks(reserved); err != nil {
				return err
			}
			for _, r := range gitRoots {
				if !filepath.IsAbs(r) {
					return errdefs.InvalidArgument("--gitsource-file-root %q: want an absolute directory such as /srv/git", r)
				}
				if fi, err := os.Stat(r); err != nil || !fi.IsDir() {
					return errdefs.InvalidArgument("--gitsource-file-root %q: not a directory on this machine", r)
				}
				cfg.GitFileRoots = append(cfg.GitFileRoots, r)
			}
			cfg.ElectionTTL = electionTTL
			cfg.HeartbeatInterval = heartbeat
			cfg.AgentSilence = silence
			if cfg.Lifecycle, cfg.APIOnly, err = lifecycleMode(lifecycle, cmd.Flags().Changed("lifecycle"), apiOnly, simulate); err != nil {
				return err
			}
			cfg.ExpectedBootTime = expectedBoot
			cfg.ProvisionMaxInFlight = maxInFlight
			if maxInFlight <= 0 {
				cfg.ProvisionMaxInFlight = -1 // no limit
			}
			cfg.BootURL = bootURL
			cfg.ControllerURL = ctlURL
			cfg.Simulate = simulate
			cfg.Shards = shards
			cfg.MetricsListenAddr = metricsAddr
			cfg.EtcdCompaction, cfg.EtcdQuotaBytes = compaction, quota
			boot.apply(&cfg)
			exec.apply(&cfg)
			if err := stepTimeouts.apply(&cfg); err != nil {
				return err
			}
			if err := security.apply(&cfg); err != nil {
				return err
			}
			ctl, err := controller.New(cfg, log)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			go func() {
				select {
				case <-ctl.Ready():
					// Type=notify (kiln-controller.service): serving now.
					if _, err := systemd.NotifyReady(); err != nil {
						log.Warn("telling systemd the controller is ready failed", "error", err)
					}
					fmt.Fprintf(cmd.OutOrStdout(), "kiln-controller %s serving on %s\nCA hash: %s\nadmin kilnconfig: %s\n",
						version.Version, ctl.Addr(), ctl.CA().Hash(), ctl.AdminConfigPath())
					if a := ctl.MetricsAddr(); a != "" {
						fmt.Fprintf(cmd.OutOrStdout(), "metrics: http://%s/metrics\n", a)
					}
					if a := ctl.BootAddr(); a != "" {
						fmt.Fprintf(cmd.OutOrStdout(), "boot server: http://%s\n", a)
					}
				case <-ctx.Done():
				}
			}()
			return ctl.Run(ctx)
		},
	}
	c.bind(cmd)
	cmd.Flags().StringVar(&listen, "listen", controller.DefaultListenAddr, "gRPC API address (host:port)")
	cmd.Flags().StringVar(&id, "id", "", "replica name in the leader election (default <hostname>-<pid>)")
	cmd.Flags().StringSliceVar(&serverNames, "server-name", nil, "extra DNS names or IPs for the API certificate (repeatable)")
	cmd.Flags().StringSliceVar(&reserved, "reserved-network", nil, "a network (CIDR) no Cluster's pod or service CIDR may overlap, such as the rack's provisioning or BMC network; repeatable (the controller's own subnets always count; networks agents report only warn)")
	cmd.Flags().StringArrayVar(&gitRoots, "gitsource-file-root", nil, "a directory under which GitSources may name file:// repositories (repeatable; none: file:// GitSources are refused, docs/gitops.md)")
	cmd.Flags().DurationVar(&electionTTL, "election-ttl", controller.DefaultElectionTTL, "leader lease; a crashed leader is replaced after about this long")
	cmd.Flags().DurationVar(&heartbeat, "heartbeat-interval", 10*time.Second, "interval agents are told to send heartbeats at")
	cmd.Flags().DurationVar(&silence, "agent-silence", 0, "silence after which a host is marked AgentReachable=False (default 3 heartbeat intervals)")
	cmd.Flags().BoolVar(&apiOnly, "api-only", false, "serve the API only: run neither the host lifecycle (power hosts through their BMCs, boot the agent media, lay images; docs/lifecycle.md) nor the cluster executor (bind Machines to hosts, kubeadm init/join through the agent; docs/clusters.md), and stay out of the leader election; for extra API replicas next to one that runs them (docs/controller.md)")
	cmd.Flags().BoolVar(&lifecycle, "lifecycle", true, "run the host lifecycle and the cluster executor (the default); --lifecycle=false is --api-only")
	_ = cmd.Flags().MarkDeprecated("lifecycle", "the lifecycle runs by default; use --api-only to turn it off")
	cmd.Flags().IntVar(&maxInFlight, "provision-max-in-flight", provision.DefaultMaxInFlight, "hosts provisioning at once (per shard with --shards); a host beyond it stays Available with ProvisioningAdmitted=False (WaitingForSlot) until one ends; 0 or less: no limit (docs/lifecycle.md)")
	cmd.Flags().DurationVar(&expectedBoot, "expected-boot-time", hostlife.DefaultExpectedBoot, "how long a host normally takes from power on to its boot agent's check-in; past it the host says BootAgentCheckedIn=False (BootAgentMissing) while it waits on")
	cmd.Flags().DurationVar(&compaction.Retention, "etcd-compaction-retention", store.DefaultCompactionRetention, "embedded etcd: keep every change younger than this for watches to resume from (unless --etcd-compaction-max-revisions or --etcd-compaction-max-history-bytes cuts it); negative: no time bound")
	cmd.Flags().Int64Var(&compaction.MaxRevisions, "etcd-compaction-max-revisions", store.DefaultCompactionMaxRevisions, "embedded etcd: keep at most this many changes of history (about 1 KiB each); negative: no bound")
	cmd.Flags().Int64Var(&compaction.MaxHistoryBytes, "etcd-compaction-max-history-bytes", store.DefaultCompactionMaxHistoryBytes, "embedded etcd: compact when the database in use has grown this much since the last compaction, keeping about 10 s of history (what holds the database to a size during a provisioning wave); negative: no bound")
	cmd.Flags().Int64Var(&quota, "etcd-quota-bytes", store.DefaultQuotaBytes, "embedded etcd: database size past which etcd refuses every write (alarm NOSPACE); a warning is logged at 80 %")
	cmd.Flags().StringVar(&metricsAddr, "metrics-listen", "", "serve Prometheus metrics over plain HTTP at /metrics on this address (host:port; off when empty; see docs/observability.md)")
	cmd.Flags().StringVar(&bootURL, "boot-url", "", "public URL of the boot server (agent ISOs for virtual media; default http://<--boot-listen> when that is an IP address)")
	cmd.Flags().StringVar(&ctlURL, "controller-url", "", "URL installed and boot agents reach the API at (default https://<listen address>)")
	boot.bind(cmd)
	exec.bind(cmd)
	stepTimeouts.bind(cmd)
	security.bind(cmd)
	cmd.Flags().IntVar(&shards, "shards", 0, "run the host lifecycle on every replica, hosts partitioned into N shards owned through etcd leases (same N on every replica; 0: the elected leader runs it all; docs/scale.md)")
	cmd.Flags().IntVar(&simulate, "simulate", 0, "create N simulated hosts with simulated BMCs and agents and provision them (demo)")
	return cmd
}

// lifecycleMode turns the --lifecycle (set: given on the command line),
// --api-only and --simulate flags into Config.Lifecycle and Config.APIOnly:
// the lifecycle runs unless --api-only or --lifecycle=false. It returns
// an error for flags that contradict each other.
func lifecycleMode(lifecycle, set, apiOnly bool, simulate int) (run, only bool, err error) {
	if !apiOnly && lifecycle {
		return true, false, nil
	}
	if apiOnly && set && lifecycle {
		return false, false, fmt.Errorf("--api-only and --lifecycle contradict each other: an API-only replica runs no lifecycle")
	}
	if simulate > 0 {
		return false, false, fmt.Errorf("--simulate drives simulated hosts through the lifecycle: it cannot run with --api-only (or --lifecycle=false)")
	}
	return false, true, nil
}

func operatorCertCmd() *cobra.Command {
	var (
		c                    common
		role, name, out, srv string
	)
	cmd := &cobra.Command{
		Use:   "operator-cert --role reader|operator|admin --name NAME -o FILE",
		Short: "Issue an operator certificate and write a kilnconfig for it",
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := c.logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			if err := operatorcert.Write(ctx, c.state(), operatorcert.Request{
				Role: role, Name: name, Server: srv, Out: out,
			}, log); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s (role %s, name %s)\n", out, role, name)
			return nil
		},
	}
	c.bind(cmd)
	cmd.Flags().StringVar(&role, "role", "", "reader, operator or admin")
	cmd.Flags().StringVar(&name, "name", "", "operator name (certificate identity)")
	cmd.Flags().StringVarP(&out, "output", "o", "", "kilnconfig file to write")
	cmd.Flags().StringVar(&srv, "server", "", "API address to write (default: the admin kilnconfig's)")
	_ = cmd.MarkFlagRequired("role")
	_ = cmd.MarkFlagRequired("name")
	_ = cmd.MarkFlagRequired("output")
	return cmd
}

func restoreCmd() *cobra.Command {
	var (
		c              common
		from, identity string
		replace        bool
	)
	cmd := &cobra.Command{
		Use:   "restore --from FILE --identity KEYFILE --data-dir DIR",
		Short: "Restore a backup made by kilnctl backup onto this controller",
		Long: `Restore a backup made by kilnctl backup: the sealing key becomes the
secret key file, and every resource and sealed secret goes into the store
(the embedded etcd in --data-dir, or the external etcd). Then start
kiln-controller run on the same flags: it is the controller the backup was
taken from. Agents keep their certificates and operators their
kilnconfigs (the CA is the same); no host is reprovisioned.

The controller must be stopped. A store that already holds resources is
refused unless --replace; a data directory whose secret key is another
controller's is always refused.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := c.logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			ids, err := backup.ReadIdentities(identity)
			if err != nil {
				return err
			}
			f, err := os.Open(from)
			if err != nil {
				return fmt.Errorf("restore: %w", err)
			}
			defer f.Close()
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			info, err := restore.Run(ctx, c.state(), restore.Request{From: f, Identities: ids, Replace: replace}, log)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "restored %d keys (backup taken at etcd revision %d) into %s; start kiln-controller run with the same flags\n", info.Keys, info.Revision, c.dataDir)
			return nil
		},
	}
	c.bind(cmd)
	cmd.Flags().StringVar(&from, "from", "", "backup file (kilnctl backup -o FILE)")
	cmd.Flags().StringVar(&identity, "identity", "", "age identity file of one of the backup's recipients (kilnctl backup keygen)")
	cmd.Flags().BoolVar(&replace, "replace", false, "delete what the store holds first")
	_ = cmd.MarkFlagRequired("from")
	_ = cmd.MarkFlagRequired("identity")
	return cmd
}

func rotateSecretKeyCmd() *cobra.Command {
	var (
		c     common
		phase string
	)
	cmd := &cobra.Command{
		Use:   "rotate-secret-key [--data-dir DIR | --etcd-endpoints URLS] [--secret-key-file FILE]",
		Short: "Re-seal every secret at rest under a new secret key and retire the old one",
		Long: `Rotate the key that seals secrets at rest (BMC passwords, the CA key,
cluster credentials): make a new key, switch the secret key file to it
keeping the old one as FILE.prev, re-seal every secret in the store under
the new key, and remove FILE.prev once nothing is sealed under it.

It works on a stopped controller (it opens the embedded etcd of --data-dir),
on a running one (through its embedded etcd's client URL, or
--etcd-endpoints): running controllers that read the same key file seal
under the new key from the switch on and open both meanwhile. A secret
written during the rotation is never lost: each is re-sealed in an etcd
transaction on its revision, retried on a concurrent change.

Every step leaves every secret openable. Interrupted (Ctrl-C, a crash, etcd
unavailable), run it again: it carries on with the same new key.

Replicas that each keep their own copy of the key file, in this order:
  1. on one:        kiln-controller rotate-secret-key --phase prepare
     and copy FILE.next (mode 0600) next to every replica's key file;
  2. on every one:  kiln-controller rotate-secret-key --phase switch
  3. on every one:  kiln-controller rotate-secret-key
     (the first re-seals everything; each removes its FILE.prev).

Take a new backup (kilnctl backup) afterwards: older backups hold the old
key, and backups are refused while a rotation is under way. The key never
appears in the output or the logs; keys are named by an id (a hash prefix).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := c.logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			p, err := rekey.ParsePhase(phase)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			out := cmd.OutOrStdout()
			res, err := rekey.Rotate(ctx, c.state(), rekey.Request{
				Phase:    p,
				Progress: func(path string) { fmt.Fprintf(out, "re-sealed %s\n", path) },
			}, log)
			if err != nil {
				return err
			}
			if res.Resumed && p == rekey.All {
				fmt.Fprintln(out, "carried on with the rotation already under way (interrupted, or earlier phases); no other key made")
			}
			switch p {
			case rekey.Prepare:
				made := "kept the existing"
				if res.Created {
					made = "wrote a new"
				}
				fmt.Fprintf(out, "%s next key %s; copy it next to every replica's key file that is not this one, then run --phase switch on each\n", made, res.New)
			case rekey.Switch:
				fmt.Fprintf(out, "switched to key %s (key %s kept to open what is not re-sealed yet); run kiln-controller rotate-secret-key once every replica is switched\n", res.New, res.Old)
			default:
				fmt.Fprintf(out, "rotated the secret key: %d of %d secrets re-sealed under key %s (%d retried after a concurrent write); key %s retired\ntake a new backup: older ones hold the old key\n",
					res.Resealed, res.Secrets, res.New, res.Conflicts, res.Old)
			}
			return nil
		},
	}
	c.bind(cmd)
	cmd.Flags().StringVar(&phase, "phase", "all", "all (the whole rotation), prepare (write FILE.next only) or switch (switch the key file to FILE.next only; no etcd)")
	return cmd
}

func versionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Run: func(cmd *cobra.Command, _ []string) {
			fmt.Fprintln(cmd.OutOrStdout(), version.Version)
		},
	}
}

// parseNetworks parses --reserved-network values. It returns
// InvalidArgument naming the value that is not a CIDR.
func parseNetworks(vals []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, v := range vals {
		p, err := netip.ParsePrefix(v)
		if err != nil {
			return nil, errdefs.InvalidArgument("--reserved-network %q: want a CIDR such as 192.168.10.0/24", v)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}
