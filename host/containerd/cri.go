package containerd

import (
	"context"
	"encoding/json"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// DefaultSocket is containerd's socket relative to the root.
const DefaultSocket = "run/containerd/containerd.sock"

// Running is what a running containerd reports through CRI.
type Running struct {
	// Version is containerd's version ("1.6.20~ds1").
	Version string
	// RuntimeName is the default runtime's name ("runc").
	RuntimeName string
	// SystemdCgroup is the default runtime's effective option.
	SystemdCgroup bool
	// RuntimeReady reports the CRI RuntimeReady condition.
	RuntimeReady bool
}

// Driver is the cgroup driver the running containerd uses.
func (r Running) Driver() string { return Driver(r.SystemdCgroup) }

// criConfig is the part of the CRI plugin's verbose status "config" used
// here (containerd 1.6 and 2.x name these fields the same).
type criConfig struct {
	Containerd struct {
		DefaultRuntimeName string `json:"defaultRuntimeName"`
		Runtimes           map[string]struct {
			Type    string         `json:"runtimeType"`
			Options map[string]any `json:"options"`
		} `json:"runtimes"`
	} `json:"containerd"`
}

// Query asks the containerd listening on socket (a path) for its
// effective CRI configuration: what it really runs with, which is not
// necessarily what the config file says (it reads the file only at
// start). It blocks until containerd answers or ctx is done.
//
// Equivalent to: `crictl --runtime-endpoint unix:///run/containerd/containerd.sock info`.
//
// It returns an Unavailable error when nothing answers on socket, and a
// FailedPrecondition error when the CRI plugin reports no runc options.
func Query(ctx context.Context, socket string) (Running, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return Running{}, errdefs.Unavailable("containerd at %s: %v", socket, err)
	}
	defer conn.Close()
	rs := runtimeapi.NewRuntimeServiceClient(conn)
	ver, err := rs.Version(ctx, &runtimeapi.VersionRequest{})
	if err != nil {
		return Running{}, errdefs.Unavailable("containerd at %s does not answer CRI: %v", socket, err)
	}
	st, err := rs.Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		return Running{}, errdefs.Unavailable("containerd at %s: CRI status: %v", socket, err)
	}
	r := Running{Version: ver.GetRuntimeVersion()}
	for _, c := range st.GetStatus().GetConditions() {
		if c.GetType() == runtimeapi.RuntimeReady {
			r.RuntimeReady = c.GetStatus()
		}
	}
	raw, ok := st.GetInfo()["config"]
	if !ok {
		return r, errdefs.FailedPrecondition("containerd at %s: CRI status has no config", socket)
	}
	var cfg criConfig
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		return r, fmt.Errorf("containerd at %s: CRI config: %w", socket, err)
	}
	r.RuntimeName = cfg.Containerd.DefaultRuntimeName
	if r.RuntimeName == "" {
		r.RuntimeName = "runc"
	}
	rt, ok := cfg.Containerd.Runtimes[r.RuntimeName]
	if !ok {
		return r, errdefs.FailedPrecondition("containerd at %s: default runtime %q not configured", socket, r.RuntimeName)
	}
	if v, ok := rt.Options["SystemdCgroup"].(bool); ok {
		r.SystemdCgroup = v
	}
	return r, nil
}
