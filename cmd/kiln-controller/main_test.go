package main

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/kilnhq/kiln/controller"
	"github.com/kilnhq/kiln/controller/hostlife"
	"github.com/kilnhq/kiln/controller/limits"
	"github.com/kilnhq/kiln/internal/errdefs"
	"github.com/kilnhq/kiln/internal/kilnconfig"
	"github.com/kilnhq/kiln/internal/testenv"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

func build(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		testenv.Skip(t, "go toolchain not on PATH: cannot build kiln-controller")
	}
	bin := filepath.Join(t.TempDir(), "kiln-controller")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

func resources(t *testing.T, configPath string) controllerv1.ResourcesClient {
	t.Helper()
	cfg, err := kilnconfig.Load(configPath)
	require.NoError(t, err)
	tc, err := cfg.TLS()
	require.NoError(t, err)
	conn, err := grpc.NewClient(cfg.Server, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return controllerv1.NewResourcesClient(conn)
}

// TestRunAndOperatorCert runs the binary as an operator would: run,
// operator-cert while it runs, use that config, stop with SIGTERM,
// operator-cert while it is stopped.
func TestRunAndOperatorCert(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs kiln-controller: skipped with -short")
	}
	bin := build(t) // before the deadline: a cold build under load is slow
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dataDir := t.TempDir()

	out, err := exec.Command(bin, "operator-cert", "--data-dir", dataDir, "--role", "reader", "--name", "early", "-o", filepath.Join(t.TempDir(), "x.yaml")).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "start the controller once first") {
		t.Errorf("operator-cert before the first start = %v, %q; want an error telling to start the controller", err, out)
	}

	run := exec.Command(bin, "run", "--data-dir", dataDir, "--listen", "127.0.0.1:0")
	stdout, err := run.StdoutPipe()
	require.NoError(t, err)
	stderr, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
	require.NoError(t, err)
	defer stderr.Close()
	run.Stderr = stderr
	require.NoError(t, run.Start())
	exited := make(chan error, 1)
	go func() { exited <- run.Wait() }()
	t.Cleanup(func() {
		_ = run.Process.Kill()
		<-exited
	})
	hash := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if h, ok := strings.CutPrefix(sc.Text(), "CA hash: "); ok {
				hash <- h
			}
		}
	}()
	select {
	case h := <-hash:
		if !strings.HasPrefix(h, "sha256:") || len(h) != len("sha256:")+64 {
			t.Errorf("printed CA hash %q, want sha256:<64 hex>", h)
		}
	case err := <-exited:
		t.Fatalf("kiln-controller run exited: %v", err)
	case <-ctx.Done():
		t.Fatalf("kiln-controller run printed no CA hash")
	}

	reader := filepath.Join(t.TempDir(), "alice.yaml")
	out, err = exec.Command(bin, "operator-cert", "--data-dir", dataDir, "--role", "reader", "--name", "alice", "-o", reader).CombinedOutput()
	require.NoError(t, err, "operator-cert while running: %s", out)
	rc := resources(t, reader)
	_, err = rc.List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
	require.NoError(t, err, "reader List")
	_, err = rc.Apply(ctx, &controllerv1.ApplyRequest{})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("reader Apply = %v, want PermissionDenied", err)
	}
	_, err = resources(t, filepath.Join(dataDir, "kilnconfig-admin.yaml")).List(ctx, &controllerv1.ListRequest{Kind: "hosts"})
	require.NoError(t, err, "admin List")

	require.NoError(t, run.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-exited:
		require.NoError(t, err, "kiln-controller run after SIGTERM")
		exited <- nil
	case <-ctx.Done():
		t.Fatalf("kiln-controller did not exit after SIGTERM")
	}

	op := filepath.Join(t.TempDir(), "bob.yaml")
	out, err = exec.Command(bin, "operator-cert", "--data-dir", dataDir, "--role", "operator", "--name", "bob", "-o", op).CombinedOutput()
	require.NoError(t, err, "operator-cert while stopped: %s", out)
	cfg, err := kilnconfig.Load(op)
	require.NoError(t, err)
	admin, err := kilnconfig.Load(filepath.Join(dataDir, "kilnconfig-admin.yaml"))
	require.NoError(t, err)
	if cfg.CA != admin.CA || cfg.Server != admin.Server {
		t.Errorf("operator-cert wrote server %q and a CA other than the admin config's (server %q)", cfg.Server, admin.Server)
	}

	out, err = exec.Command(bin, "operator-cert", "--data-dir", dataDir, "--role", "agent", "--name", "x", "-o", filepath.Join(t.TempDir(), "x.yaml")).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "not an operator role") {
		t.Errorf("operator-cert --role agent = %v, %q; want refused", err, out)
	}
}

func TestVersion(t *testing.T) {
	var b strings.Builder
	cmd := rootCmd()
	cmd.SetOut(&b)
	cmd.SetArgs([]string{"version"})
	require.NoError(t, cmd.Execute())
	if strings.TrimSpace(b.String()) == "" {
		t.Errorf("version printed nothing")
	}
}

func TestLifecycleMode(t *testing.T) {
	tests := []struct {
		args          []string
		run, apiOnly  bool
		wantErrSubstr string
	}{
		{args: nil, run: true},
		{args: []string{"--lifecycle"}, run: true},
		{args: []string{"--simulate", "3"}, run: true},
		{args: []string{"--api-only"}, apiOnly: true},
		{args: []string{"--lifecycle=false"}, apiOnly: true},
		{args: []string{"--api-only", "--lifecycle"}, wantErrSubstr: "contradict"},
		{args: []string{"--api-only", "--simulate", "3"}, wantErrSubstr: "--simulate"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			cmd := runCmd()
			require.NoError(t, cmd.ParseFlags(tt.args))
			lifecycle, _ := cmd.Flags().GetBool("lifecycle")
			apiOnly, _ := cmd.Flags().GetBool("api-only")
			simulate, _ := cmd.Flags().GetInt("simulate")
			run, only, err := lifecycleMode(lifecycle, cmd.Flags().Changed("lifecycle"), apiOnly, simulate)
			if tt.wantErrSubstr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErrSubstr) {
					t.Errorf("lifecycleMode(%q) = %v, want an error containing %q", tt.args, err, tt.wantErrSubstr)
				}
				return
			}
			require.NoError(t, err)
			if run != tt.run || only != tt.apiOnly {
				t.Errorf("lifecycleMode(%q) = lifecycle %v, api-only %v; want %v, %v", tt.args, run, only, tt.run, tt.apiOnly)
			}
		})
	}
}

func TestParseRate(t *testing.T) {
	tests := []struct {
		in      string
		want    limits.Rate
		wantErr bool
	}{
		{"50/200", limits.Rate{PerSecond: 50, Burst: 200}, false},
		{"0.5/3", limits.Rate{PerSecond: 0.5, Burst: 3}, false},
		{"-1", limits.Rate{PerSecond: -1}, false},
		{"50", limits.Rate{}, true},
		{"0/10", limits.Rate{}, true},
		{"5/0", limits.Rate{}, true},
		{"fast", limits.Rate{}, true},
	}
	for _, tt := range tests {
		got, err := parseRate("rate-limit", tt.in)
		if (err != nil) != tt.wantErr || (!tt.wantErr && got != tt.want) {
			t.Errorf("parseRate(%q) = %v, %v, want %v (error %v)", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

// TestStepTimeoutFlag: --step-timeout STEP=DURATION, repeatable, step
// names in any case, reaches controller.Config.StepTimeouts; a bad step
// (the error lists the steps), a bad or non-positive duration, a missing
// "=" and a step named twice are refused.
func TestStepTimeoutFlag(t *testing.T) {
	tests := []struct {
		args    []string
		want    map[hostlife.Step]time.Duration
		wantErr []string
	}{
		{args: nil, want: nil},
		{args: []string{"--step-timeout", "LayImage=1m"}, want: map[hostlife.Step]time.Duration{hostlife.StepLayImage: time.Minute}},
		{args: []string{"--step-timeout", "layimage=45m", "--step-timeout=WAITBOOTAGENT=1h30m"},
			want: map[hostlife.Step]time.Duration{hostlife.StepLayImage: 45 * time.Minute, hostlife.StepWaitBootAgent: 90 * time.Minute}},
		{args: []string{"--step-timeout", "Lay=1m"}, wantErr: []string{`unknown step "Lay"`, "CheckBMC", "LayImage", "WaitInstalledAgent", "PowerOffWiped"}},
		{args: []string{"--step-timeout", "LayImage=soon"}, wantErr: []string{"positive duration"}},
		{args: []string{"--step-timeout", "LayImage=0s"}, wantErr: []string{"positive duration"}},
		{args: []string{"--step-timeout", "LayImage=-1m"}, wantErr: []string{"positive duration"}},
		{args: []string{"--step-timeout", "LayImage"}, wantErr: []string{"STEP=DURATION"}},
		{args: []string{"--step-timeout", "LayImage=1m", "--step-timeout", "layimage=2m"}, wantErr: []string{"LayImage is given twice"}},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			cmd := runCmd()
			require.NoError(t, cmd.ParseFlags(tt.args))
			vals, err := cmd.Flags().GetStringArray("step-timeout")
			require.NoError(t, err)
			var cfg controller.Config
			err = (&stepTimeoutFlags{vals: vals}).apply(&cfg)
			if tt.wantErr != nil {
				require.Error(t, err)
				require.True(t, errdefs.IsInvalidArgument(err), "%v", err)
				for _, w := range tt.wantErr {
					require.Contains(t, err.Error(), w)
				}
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, cfg.StepTimeouts)
		})
	}
}
