// Package cli is kilnctl: the commands, their flags and their output. The
// main package only calls NewCommand and Execute, so tests run the real
// CLI in process against a real controller.
package cli

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/errgrpc"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/pki"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

// Options are kilnctl's connections to the outside world.
type Options struct {
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	// Getenv reads the environment (KILNCONFIG, HOME).
	Getenv func(string) string
	// Now is the clock used for ages in tables.
	Now func() time.Time
	// Lab is the `kilnctl lab` command group; nil installs a stub that
	// says the lab is not built into this kilnctl.
	Lab *cobra.Command
}

func (o *Options) defaults() {
	if o.Stdin == nil {
		o.Stdin = os.Stdin
	}
	if o.Stdout == nil {
		o.Stdout = os.Stdout
	}
	if o.Stderr == nil {
		o.Stderr = os.Stderr
	}
	if o.Getenv == nil {
		o.Getenv = os.Getenv
	}
	if o.Now == nil {
		o.Now = time.Now
	}
}

// app is the state shared by the commands of one invocation.
type app struct {
	opts       Options
	configPath string
	timeout    time.Duration

	cfg  *kilnconfig.Config
	conn *grpc.ClientConn
}

// Run executes kilnctl with args (without the program name) and returns
// its error, unprinted. The connection to the controller is closed before
// it returns. ctx ends long-running commands (watch).
func Run(ctx context.Context, opts Options, args []string) error {
	a := newApp(opts)
	defer a.close()
	root := a.root()
	root.SetArgs(args)
	return root.ExecuteContext(ctx)
}

// NewCommand returns the kilnctl root command, for documentation and
// completion generators; Run is what executes it.
func NewCommand(opts Options) *cobra.Command { return newApp(opts).root() }

func newApp(opts Options) *app {
	opts.defaults()
	return &app{opts: opts}
}

func (a *app) root() *cobra.Command {
	opts := a.opts
	root := &cobra.Command{
		Use:   "kilnctl",
		Short: "kilnctl controls a Kiln fleet: hosts, images and the Kubernetes clusters laid on them",
		Long: `kilnctl controls a Kiln fleet: hosts, images and the Kubernetes clusters laid on them.

It reads its controller address and credentials from a kilnconfig file:
--kilnconfig, else $KILNCONFIG, else ~/.kiln/config. The controller writes
one for its admin to DATA_DIR/kilnconfig-admin.yaml.`,
		SilenceUsage:      true,
		SilenceErrors:     true,
		CompletionOptions: cobra.CompletionOptions{DisableDefaultCmd: true},
	}
	root.SetIn(opts.Stdin)
	root.SetOut(opts.Stdout)
	root.SetErr(opts.Stderr)
	root.PersistentFlags().StringVar(&a.configPath, "kilnconfig", "", "path of the kilnconfig file (default $KILNCONFIG, else ~/.kiln/config)")
	root.PersistentFlags().DurationVar(&a.timeout, "request-timeout", 30*time.Second, "deadline of each call to the controller")

	root.AddCommand(
		a.applyCommand(),
		a.diffCommand(),
		a.getCommand(),
		a.describeCommand(),
		a.deleteCommand(),
		a.watchCommand(),
		a.waitCommand(),
		a.rolloutCommand(),
		a.kubeconfigCommand(),
		a.tokenCommand(),
		a.auditCommand(),
		a.backupCommand(),
		a.moveCommand(),
		a.dnsmasqConfigCommand(),
		a.dashboardCommand(),
		completionCommand(),
		versionCommand(),
	)
	if opts.Lab != nil {
		root.AddCommand(opts.Lab)
	} else {
		root.AddCommand(labStub())
	}
	return root
}

// client loads the config and dials the controller, once per invocation.
func (a *app) client(ctx context.Context) (controllerv1.ResourcesClient, error) {
	if a.conn == nil {
		path := kilnconfig.Resolve(a.configPath, a.opts.Getenv)
		cfg, err := kilnconfig.Load(path)
		if err != nil {
			if errdefs.IsNotFound(err) && a.configPath == "" && a.opts.Getenv(kilnconfig.EnvVar) == "" {
				return nil, errdefs.NotFound("no kilnctl config: pass --kilnconfig or set KILNCONFIG; the controller writes DATA_DIR/kilnconfig-admin.yaml (looked for %s)", path)
			}
			return nil, err
		}
		conn, err := kilnconfig.Dial(ctx, cfg)
		if err != nil {
			return nil, err
		}
		a.cfg, a.conn = cfg, conn
	}
	return controllerv1.NewResourcesClient(a.conn), nil
}

func (a *app) close() {
	if a.conn != nil {
		a.conn.Close()
		a.conn = nil
	}
}

// call bounds a unary call by --request-timeout.
func (a *app) call(ctx context.Context) (context.Context, context.CancelFunc) {
	if a.timeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, a.timeout)
}

// rpcError turns a gRPC error into an errdefs error with a message a user
// can act on: what was being done, what the controller said, and a hint
// for permission and connection problems.
func (a *app) rpcError(what string, err error) error {
	if err == nil {
		return nil
	}
	if st, ok := status.FromError(err); ok && st.Code() == codes.ResourceExhausted {
		// The controller's limits (docs/security.md).
		hint := "the controller limits each caller's request rate and open watches; wait as it says and retry"
		if strings.Contains(st.Message(), "larger than max") {
			hint = "the request is larger than the controller accepts (kiln-controller run --max-message-size); apply the objects in several smaller files"
		}
		return fmt.Errorf("%s: the controller refused the request: %s\nhint: %s", what, st.Message(), hint)
	}
	e := errgrpc.FromGRPC(err)
	switch {
	case errdefs.IsPermissionDenied(e):
		return fmt.Errorf("%s: %w\nhint: %s", what, e, a.roleHint())
	case errdefs.IsConflict(e):
		return fmt.Errorf("%s: %w\nhint: the file names a metadata.resourceVersion and the object changed since; get it again, or remove resourceVersion to apply over the change", what, e)
	case errdefs.IsUnavailable(e):
		server := ""
		if a.cfg != nil {
			server = " at " + a.cfg.Server
		}
		if strings.Contains(e.Error(), "certificate signed by unknown authority") {
			// The handshake failed on trust, not on reachability: most
			// often a kilnconfig from before kiln-controller rotate-ca
			// retired the CA it names (docs/controller.md).
			return fmt.Errorf("%s: the controller%s presents a certificate of a CA this kilnconfig does not trust: %w\nhint: was the controller CA rotated (kiln-controller rotate-ca)? get a new kilnconfig (kiln-controller operator-cert)", what, server, e)
		}
		return fmt.Errorf("%s: cannot reach the controller%s: %w", what, server, e)
	case errors.Is(e, context.DeadlineExceeded) || errors.Is(e, errdefs.ErrDeadlineExceeded):
		return fmt.Errorf("%s: no answer within --request-timeout %v: %w", what, a.timeout, e)
	}
	return fmt.Errorf("%s: %w", what, e)
}

// roleHint names the role of the configured certificate and the roles a
// change needs.
func (a *app) roleHint() string {
	return a.certHint("changes need an operator or admin certificate; ask an admin for a kilnconfig with one")
}

// certHint prefixes need with the role and name of the kilnconfig's
// certificate, when it can be read.
func (a *app) certHint(need string) string {
	if a.cfg == nil {
		return need
	}
	block, _ := pem.Decode([]byte(a.cfg.Cert))
	if block == nil {
		return need
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return need
	}
	role, name, err := pki.Identity(cert)
	if err != nil {
		return need
	}
	article := "a"
	if r := string(role); r != "" && strings.ContainsRune("aeiou", rune(r[0])) {
		article = "an"
	}
	return fmt.Sprintf("kilnconfig %s holds %s %s certificate for %q; %s", a.cfg.Path, article, role, name, need)
}
