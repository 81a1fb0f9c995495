package fleet

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/rack"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// SetBMCFaults sends faults (the JSON of redfish.Faults, e.g.
// `{"failNext":1000,"failStatus":503}`) to the Redfish emulator of the lab
// host whose Host resource is host; "" clears them. The emulator listens
// on loopback; the request uses the BMC's own credentials.
func (l *Lab) SetBMCFaults(ctx context.Context, host, faults string) error {
	st, err := rack.ReadState(l.StateDir())
	if err != nil {
		return err
	}
	creds, err := rack.ReadCredentials(l.StateDir())
	if err != nil {
		return err
	}
	for _, h := range st.Hosts {
		if h.Resource != host {
			continue
		}
		if h.BMC.Protocol != rack.ProtocolRedfish {
			return errdefs.InvalidArgument("lab: host %s has a %s BMC: faults are injected into Redfish emulators only", host, h.BMC.Protocol)
		}
		method, body := http.MethodPatch, io.Reader(strings.NewReader(faults))
		if faults == "" {
			method, body = http.MethodDelete, http.NoBody
		}
		req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(h.BMC.Address, "/")+redfish.AdminPath, body)
		if err != nil {
			return err
		}
		c := creds[h.Name]
		req.SetBasicAuth(c.Username, c.Password)
		req.Header.Set("Content-Type", "application/json")
		// The emulator's certificate is self-signed (as the Host's
		// insecureSkipVerify says).
		cl := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // lab emulator on loopback
		resp, err := cl.Do(req)
		if err != nil {
			return fmt.Errorf("lab: BMC faults of %s: %w", host, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("lab: BMC faults of %s: %s: %s", host, resp.Status, bytes.TrimSpace(b))
		}
		return nil
	}
	return errdefs.NotFound("lab: no host %s", host)
}
