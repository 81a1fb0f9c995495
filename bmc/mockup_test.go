package bmc_test

import (
	"context"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kilnhq/kiln/bmc"
	"github.com/kilnhq/kiln/e2e/lab/redfish"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/testenv"
)

// mockupDir finds the DMTF mockups (see redfish.MockupsDir): it skips
// when there are none and fails when KILN_REDFISH_MOCKUPS names none.
func mockupDir(t *testing.T) string {
	t.Helper()
	d, err := redfish.MockupsDir()
	if errdefs.IsNotFound(err) {
		testenv.Skip(t, err.Error())
	}
	require.NoError(t, err)
	return d
}

func serveMockup(t *testing.T, tree string) string {
	dir := filepath.Join(mockupDir(t), tree)
	if _, err := os.Stat(filepath.Join(dir, "index.json")); err != nil {
		testenv.Skipf(t, "mockup tree %s is not in %s", tree, filepath.Dir(dir))
	}
	srv := httptest.NewServer(redfish.MockupHandler(dir))
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

// TestMockupBasicAuth: a DMTF tree read with basic authentication, and
// slots without InsertMedia or EjectMedia refused as NotSupported without
// retries.
func TestMockupBasicAuth(t *testing.T) {
	url := serveMockup(t, "public-tower")
	b, err := bmc.Dial(context.Background(), bmc.Endpoint{
		Protocol: bmc.ProtocolRedfish, Address: url, Username: "root", Password: "pw", Auth: bmc.AuthBasic,
	}, fastOpts("tower"))
	require.NoError(t, err)
	ctx := ctxTimeout(t, 10*time.Second)
	if _, err := b.Inventory(ctx); err != nil {
		t.Fatalf("Inventory() with basic auth = %v, want nil", err)
	}
	if err := b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/a.iso"); !errdefs.IsNotSupported(err) {
		t.Fatalf("InsertVirtualMedia() without an insertable slot = %v, want NotSupported", err)
	}
	// CD1 holds freeOS.1.1.iso and offers no EjectMedia: an eject cannot
	// succeed, and saying so is the truth.
	err = b.EjectVirtualMedia(ctx)
	if !errdefs.IsNotSupported(err) || !strings.Contains(err.Error(), `virtual media slot CD1 holds "redfish.dmtf.org/freeImages/freeOS.1.1.iso" and offers no EjectMedia action`) {
		t.Fatalf("EjectVirtualMedia() on a slot without EjectMedia = %v, want NotSupported naming the slot and image", err)
	}
	if st := b.Stats(); st.Attempts != st.Calls {
		t.Fatalf("Stats() = %+v: NotSupported was retried", st)
	}
}

// TestMockupTreesDriven drives power, one-time boot and virtual media on
// every tree KILN_REDFISH_MOCKUPS (or the fixtures) holds, through the
// mockup handler's write overlay. On a BMC with several Physical systems
// the first is named by id.
func TestMockupTreesDriven(t *testing.T) {
	dir := mockupDir(t)
	trees, err := redfish.MockupTrees(dir)
	require.NoError(t, err)
	for _, tree := range trees {
		t.Run(tree, func(t *testing.T) {
			url := serveMockup(t, tree)
			ctx := ctxTimeout(t, 30*time.Second)
			dial := func(systemID string) *bmc.BMC {
				b, err := bmc.Dial(ctx, bmc.Endpoint{Protocol: bmc.ProtocolRedfish, Address: url, Username: "root", Password: "pw", SystemID: systemID}, fastOpts(tree))
				require.NoError(t, err)
				return b
			}
			b := dial("")
			inv, err := b.Inventory(ctx)
			if errdefs.IsInvalidArgument(err) {
				// "the bmc has N systems (ID (Type), ...)": take the first id.
				_, list, _ := strings.Cut(err.Error(), "systems (")
				id, _, _ := strings.Cut(list, " ")
				t.Logf("%s: %v; using system %s", tree, err, id)
				b = dial(id)
				inv, err = b.Inventory(ctx)
			}
			require.NoError(t, err)
			t.Logf("%s: system %s, %s %s, %d MACs", tree, inv.SystemID, inv.Manufacturer, inv.Model, len(inv.MACs))

			require.NoError(t, b.PowerOff(ctx))
			if s, err := b.PowerState(ctx); err != nil || s != bmc.PowerOff {
				t.Fatalf("PowerState() after PowerOff = %q, %v", s, err)
			}
			caps, err := b.Capabilities(ctx)
			require.NoError(t, err)
			require.NoError(t, b.SetBootDevice(ctx, bmc.BootPXE, false, true))
			require.NoError(t, b.PowerOn(ctx))
			if s, err := b.PowerState(ctx); err != nil || s != bmc.PowerOn {
				t.Fatalf("PowerState() after PowerOn = %q, %v", s, err)
			}
			require.NoError(t, b.PowerCycle(ctx))
			if caps.VirtualMedia {
				require.NoError(t, b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/agent.iso"))
				require.NoError(t, b.EjectVirtualMedia(ctx))
			} else if err := b.InsertVirtualMedia(ctx, "http://127.0.0.1:9/agent.iso"); !errdefs.IsNotSupported(err) {
				t.Fatalf("InsertVirtualMedia() without an insertable slot = %v, want NotSupported", err)
			}
		})
	}
}
