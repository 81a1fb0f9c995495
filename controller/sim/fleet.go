package sim

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnhq/kiln/controller/enrollment"
	"github.com/kilnhq/kiln/internal/errdefs"
	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// EnrollmentCheckIn makes simulated agents check in through the
// controller's enrollment service, as real agents' heartbeats do.
func EnrollmentCheckIn(s *enrollment.Service) CheckIn {
	return func(ctx context.Context, host, address string, facts *typesv1.Facts, factsSHA256 string) (bool, error) {
		r, err := s.SimulatedHeartbeat(ctx, host, enrollment.HeartbeatRequest{AgentAddress: address, Facts: facts, FactsSHA256: factsSHA256, Version: "sim"})
		return r.FactsWanted, err
	}
}

// Creator creates resources (*store.Store).
type Creator interface {
	Create(ctx context.Context, kind, name string, m proto.Message) (int64, error)
}

// ImageName is the image Populate creates and binds.
const ImageName = "debian12-k8s1.34.4-20261201"

// HostName is the name of simulated host i (1-based) of prefix.
func HostName(prefix string, i int) string { return fmt.Sprintf("%s-%05d", prefix, i) }

// Populate stores an Image and n Hosts named HostName(prefix, i), each
// bound (status.machine) to a Machine of its own that wants the image.
// Every fourth host has an IPMI BMC (PXE boot), the rest Redfish (virtual
// media). Existing resources are kept.
func Populate(ctx context.Context, st Creator, n int, prefix string) ([]string, error) {
	now := timestamppb.Now()
	img := &typesv1.Image{
		ApiVersion: "kiln.dev/v1", Kind: "Image",
		Metadata: &typesv1.ObjectMeta{Name: ImageName, Generation: 1, CreationTimestamp: now},
		Spec: &typesv1.ImageSpec{
			Url: "http://images.sim/" + ImageName + ".raw.zst", Format: "raw.zst",
			Sha256: "4f1c8d0bb1d1a0f2b9b6f1d0e7c5c6a1b2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7", KubernetesVersion: "v1.34.4",
		},
	}
	if _, err := st.Create(ctx, "images", ImageName, img); err != nil && !errdefs.IsAlreadyExists(err) {
		return nil, err
	}
	names := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	next := make(chan int)
	for range min(n, 32) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				names[i-1], errs[i-1] = populateOne(ctx, st, prefix, i, now)
			}
		}()
	}
	for i := 1; i <= n; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	return names, errors.Join(errs...)
}

func populateOne(ctx context.Context, st Creator, prefix string, i int, now *timestamppb.Timestamp) (string, error) {
	name := HostName(prefix, i)
	protocol := "redfish"
	if i%4 == 0 {
		protocol = "ipmi"
	}
	m := &typesv1.Machine{
		ApiVersion: "kiln.dev/v1", Kind: "Machine",
		Metadata: &typesv1.ObjectMeta{Name: "m-" + name, Generation: 1, CreationTimestamp: now},
		Spec:     &typesv1.MachineSpec{Cluster: "sim", Role: "worker", Host: name, Version: "v1.34.4", Image: ImageName, Owner: "MachineDeployment/sim"},
	}
	if _, err := st.Create(ctx, "machines", m.Metadata.Name, m); err != nil && !errdefs.IsAlreadyExists(err) {
		return name, err
	}
	h := &typesv1.Host{
		ApiVersion: "kiln.dev/v1", Kind: "Host",
		Metadata: &typesv1.ObjectMeta{Name: name, Generation: 1, CreationTimestamp: now, Labels: map[string]string{"rack": fmt.Sprintf("r%03d", (i-1)/40+1)}},
		Spec:     &typesv1.HostSpec{Bmc: &typesv1.BMCSpec{Protocol: protocol, Address: "sim://" + name}, RootDiskHint: "/dev/sda", Online: true},
		Status:   &typesv1.HostStatus{Machine: m.Metadata.Name},
	}
	if _, err := st.Create(ctx, "hosts", name, h); err != nil && !errdefs.IsAlreadyExists(err) {
		return name, err
	}
	return name, nil
}
