package cli

import (
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"log/slog"
	"net"
	"strings"

	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"

	"github.com/kilnhq/kiln/cmd/kilnctl/internal/dashboard"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/pki"
)

func (a *app) dashboardCommand() *cobra.Command {
	var listen string
	cmd := &cobra.Command{
		Use:   "dashboard",
		Short: "Serve a read-only web view of the fleet on a loopback port",
		Long: `Serve a read-only web view of the fleet on a loopback port, and print
the URL to open.

kilnctl reads the controller's API with the kilnconfig's certificate, as
kilnctl get does: the controller's roles apply (reader and above), and the
dashboard calls only Get, List, Watch and ListEvents. Pages update live
from the controller's watch streams.

The URL carries a one-time token: the first browser to open it gets an
HttpOnly session cookie and every other request is refused (401), so
other users of this machine cannot read the fleet through the port. Open
the printed URL, not a bookmark: each start makes a new token. The
dashboard answers only to its loopback address (403 to another Host or
Origin) and only to GET (405). It runs until interrupted.`,
		Example: "  kilnctl dashboard\n  kilnctl dashboard --listen 127.0.0.1:8080",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := loopbackListen(listen); err != nil {
				return err
			}
			c, err := a.client(cmd.Context())
			if err != nil {
				return err
			}
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelWarn}))
			d, err := dashboard.New(dashboard.Config{
				API: c, Controller: a.cfg.Server, Identity: a.identity(), Log: log, Now: a.opts.Now, CallTimeout: a.timeout,
			})
			if err != nil {
				return err
			}
			var lc net.ListenConfig
			ln, err := lc.Listen(cmd.Context(), "tcp", listen)
			if err != nil {
				return errdefs.Unavailable("dashboard: listen on %s: %v", listen, err)
			}
			url, err := d.Bind(ln)
			if err != nil {
				ln.Close()
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "Kiln dashboard of %s, read-only, as %s.\nOpen this URL once: its token works one time. Ctrl-C stops the dashboard.\n\n    %s\n\n", a.cfg.Server, orDefault(a.identity(), "this kilnconfig"), url)
			g, ctx := errgroup.WithContext(cmd.Context())
			g.Go(func() error { return d.Run(ctx) })
			g.Go(func() error { return d.Serve(ctx, ln) })
			err = g.Wait()
			if cmd.Context().Err() != nil {
				return nil
			}
			return err
		},
	}
	cmd.Flags().StringVar(&listen, "listen", "127.0.0.1:0", "loopback address and port to serve on (port 0 picks a free one)")
	return cmd
}

// loopbackListen refuses a listen address that is not a loopback IP:
// the dashboard's token protects it from other local users, not from
// the network.
func loopbackListen(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return errdefs.InvalidArgument("--listen %q: use a loopback address and port such as 127.0.0.1:8080", addr)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return errdefs.InvalidArgument("--listen %q: the dashboard serves only on loopback (127.0.0.1 or [::1]); reach it from another machine through an SSH tunnel (ssh -L)", addr)
	}
	return nil
}

// identity is "reader alice" for the kilnconfig's certificate, or "".
func (a *app) identity() string {
	if a.cfg == nil {
		return ""
	}
	block, _ := pem.Decode([]byte(a.cfg.Cert))
	if block == nil {
		return ""
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return ""
	}
	role, name, err := pki.Identity(cert)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(fmt.Sprintf("%s %s", role, name))
}
