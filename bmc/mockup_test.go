package bmc_test

import (
	"context"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// mockupDir finds the DMTF mockups (see redfish.MockupsDir).
func mockupDir(t *testing.T) string {
	t.Helper()
	d, err := redfish.MockupsDir()
	if err != nil {
		t.Skip(err.Error())
	}
	return d
}

func serveMockup(t *testing.T, tree string) string {
	srv := httptest.NewServer(redfish.MockupHandler(filepath.Join(mockupDir(t), tree)))
	t.Cleanup(srv.Close)
	return srv.URL
}

func TestMockups(t *testing.T) {
	tests := []struct {
		tree     string
		systemID string
		want     bmc.Inventory
		// slots is "ID:types:insertable" per virtual media slot.
		slots        []string
		virtualMedia bool
	}{
		{
			tree: "public-rackmount1",
			want: bmc.Inventory{Manufacturer: "Contoso", Model: "3500", SerialNumber: "437XR1138R2", BMCFirmware: "1.45.455b66-rev4",
				MACs: []string{"12:44:6a:3b:04:11", "aa:bb:cc:dd:ee:00", "aa:bb:cc:dd:ee:fe"}},
			// Virtual media under the system, without Insert/Eject actions.
			slots: []string{"CD1:CD,DVD:false", "CD2:CD,DVD:false", "Floppy1:Floppy,USBStick:false"},
		},
		{
			tree: "public-tower",
			want: bmc.Inventory{Manufacturer: "Contoso", Model: "3500", SerialNumber: "437XR1238R2", BMCFirmware: "1.45.455b66-rev4",
				MACs: []string{"fb:aa:1d:4e:d0:7a", "fb:aa:1d:4e:d0:7c"}},
			slots: []string{"CD1:CD,DVD:false", "Floppy1:Floppy,USBStick:false"},
		},
		{
			tree:         "public-telemetry",
			want:         bmc.Inventory{Model: "Model Name", SerialNumber: "2M220100SL", BMCFirmware: "1.00"},
			slots:        []string{"CD1:CD,DVD:true", "Floppy1:Floppy,USBStick:false"},
			virtualMedia: true,
		},
		{
			// Four systems all named "Bladed System": selected by Id.
			tree:     "public-bladed",
			systemID: "529QB9452R6",
			want:     bmc.Inventory{Model: "SX1000", SerialNumber: "529QB9452R6", BMCFirmware: "1.00"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.tree, func(t *testing.T) {
			url := serveMockup(t, tt.tree)
			b, err := bmc.Dial(context.Background(), bmc.Endpoint{
				Protocol: bmc.ProtocolRedfish, Address: url, Username: "root", Password: "mockup-pw", SystemID: tt.systemID,
			}, fastOpts(tt.tree))
			require.NoError(t, err)
			ctx := ctxTimeout(t, 30*time.Second)

			inv, err := b.Inventory(ctx)
			require.NoError(t, err)
			if inv.Manufacturer == "" {
				inv.Manufacturer = tt.want.Manufacturer // not every mockup names one
			}
			if strings.Join(inv.MACs, ",") != strings.Join(tt.want.MACs, ",") || inv.Model != tt.want.Model ||
				inv.SerialNumber != tt.want.SerialNumber || inv.BMCFirmware != tt.want.BMCFirmware {
				t.Fatalf("Inventory(%q) = %+v, want %+v", tt.tree, inv, tt.want)
			}

			state, err := b.PowerState(ctx)
			require.NoError(t, err)
			if state != bmc.PowerOn {
				t.Fatalf("PowerState(%q) = %q, want on", tt.tree, state)
			}

			caps, err := b.Capabilities(ctx)
			require.NoError(t, err)
			var slots []string
			for _, s := range caps.MediaSlots {
				slots = append(slots, s.ID+":"+strings.Join(s.Types, ",")+":"+map[bool]string{true: "true", false: "false"}[s.Insertable])
			}
			if strings.Join(slots, " ") != strings.Join(tt.slots, " ") || caps.VirtualMedia != tt.virtualMedia {
				t.Fatalf("Capabilities(%q) = slots %v virtual media %v, want %v %v", tt.tree, slots, caps.VirtualMedia, tt.slots, tt.virtualMedia)
			}
			// Every DMTF mockup links a SessionService: auto picks sessions.
			if caps.Auth != bmc.AuthSession {
				t.Fatalf("Capabilities(%q).Auth = %q, want session", tt.tree, caps.Auth)
			}
			if !tt.virtualMedia {
				err := b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/a.iso")
				if !errdefs.IsNotSupported(err) {
					t.Fatalf("InsertVirtualMedia(%q) without an insertable slot = %v, want NotSupported", tt.tree, err)
				}
			}
		})
	}
}

// TestMockupErrors: what a read-only DMTF tree answers to writes is
// translated, classed NotSupported and not retried.
func TestMockupErrors(t *testing.T) {
	url := serveMockup(t, "public-tower")
	b, err := bmc.Dial(context.Background(), bmc.Endpoint{
		Protocol: bmc.ProtocolRedfish, Address: url, Username: "root", Password: "pw", Auth: bmc.AuthBasic,
	}, fastOpts("tower"))
	require.NoError(t, err)
	ctx := ctxTimeout(t, 10*time.Second)
	if _, err := b.Inventory(ctx); err != nil {
		t.Fatalf("Inventory() with basic auth = %v, want nil", err)
	}
	err = b.PowerOff(ctx)
	if !errdefs.IsNotSupported(err) || !strings.Contains(err.Error(), "does not support this request (405 Base.1.8.OperationNotAllowed") {
		t.Fatalf("PowerOff() on a read-only mockup = %v, want NotSupported ... 405", err)
	}
	if st := b.Stats(); st.Attempts != st.Calls {
		t.Fatalf("Stats() = %+v: NotSupported was retried", st)
	}
}

func TestMockupBladedNeedsSystemID(t *testing.T) {
	url := serveMockup(t, "public-bladed")
	for _, tt := range []struct {
		systemID string
		check    func(error) bool
		want     string
	}{
		{"", errdefs.IsInvalidArgument, "4 systems"},
		{"nope", errdefs.IsNotFound, `no system with id "nope"`},
	} {
		b, err := bmc.Dial(context.Background(), bmc.Endpoint{
			Protocol: bmc.ProtocolRedfish, Address: url, Username: "root", Password: "pw", SystemID: tt.systemID,
		}, fastOpts("blade"))
		require.NoError(t, err)
		_, err = b.PowerState(ctxTimeout(t, 10*time.Second))
		if !tt.check(err) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("PowerState(system %q) error = %v, want one containing %q", tt.systemID, err, tt.want)
		}
	}
}
