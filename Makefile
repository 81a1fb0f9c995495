# Kiln. The two commands that matter: `make lab` and `make test`.
SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)
# The Go toolchain Kiln builds with, fetched once through the Go module proxy
# (README, "Go version"); the machine's own Go only starts it.
export GOTOOLCHAIN := $(shell cat hack/go-toolchain)
GO ?= go
BIN := bin
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -s -w -X github.com/kilnhq/kiln/internal/version.Version=$(VERSION)
BINARIES := kiln-agent kiln-controller kilnctl kiln-imagebuilder

.PHONY: all build packages test test-short fuzz check fresh-check generate bench lab lab-down lab-upgrade lab-waves test-vm kube-tools image clean $(BINARIES)

all: build

build: $(BINARIES)

# kiln-agent leaves out grpc's /debug/requests tracing: it links html/template,
# whose reflection makes the linker keep every exported method, and costs the
# agent 2.8 MiB of binary and of resident memory (docs/bench/agent.md).
TAGS_kiln-agent := grpcnotrace

$(BINARIES):
	CGO_ENABLED=0 $(GO) build -trimpath -tags '$(TAGS_$@)' -ldflags '$(LDFLAGS)' -o $(BIN)/$@ ./cmd/$@

# Debian packages of kiln-agent, kiln-controller and kilnctl in
# out/packages (docs/packages.md): the version from git describe, every
# time stamp the commit time, so two runs on one commit give identical
# files.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null)
packages: kiln-agent kiln-controller kilnctl
	SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH) $(GO) run ./hack/debpkg -bin $(BIN) -out out/packages -describe '$(VERSION)'

# Everything CI runs. Tests that need root, namespaces or tools skip with a
# reason when those are missing; CI runs as root with the tools installed.
# KILN_NO_SKIP=1 make test turns each of those skips into a failure with the
# same reason (internal/testenv); -short skips stay skips (docs/ci.md).
test:
	$(GO) test -count=1 -timeout 70m ./...

# Every fuzz target for FUZZTIME each (default 10m), one at a time;
# `make test` runs only their seed corpora (docs/security.md, "Fuzzing").
# FUZZ="FuzzDecode FuzzLoad" runs only those.
FUZZTIME ?= 10m
fuzz:
	FUZZTIME=$(FUZZTIME) ./hack/fuzz.sh $(FUZZ)

# The fast tier: no root needed.
test-short:
	$(GO) test -short ./...

generate:
	./hack/generate.sh

# gofmt, go vet (linux and darwin), generated code up to date, and no
# reachable known vulnerability (hack/vulncheck.sh, docs/security.md).
check:
	@fmt=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$fmt" ]; then echo "gofmt needed:"; echo "$$fmt"; exit 1; fi
	$(GO) vet ./...
	GOOS=darwin $(GO) vet ./...
	./hack/generate.sh
	@if [ -n "$$(git status --porcelain proto)" ]; then echo "generated code is out of date: run make generate and commit"; git status --porcelain proto; exit 1; fi
	./hack/vulncheck.sh

bench:
	./hack/bench.sh

# The install steps proven on a fresh Debian 12 root (cached debootstrap
# minbase + git make gcc ca-certificates) under systemd-nspawn, on a fresh
# clone of HEAD: hack/deps.sh, make check, make build, make test-short and
# the tests that need no namespaces (docs/ci.md, "make fresh-check").
# FRESH_REF=COMMIT checks another commit.
fresh-check:
	./hack/fresh-check.sh $(FRESH_REF)

# BACKEND=netns (default), qemu or libvirt: the machine backend of the
# lab's hosts (docs/lab.md, "make lab BACKEND=").
BACKEND ?= netns
lab: build
	BACKEND=$(BACKEND) ./hack/lab.sh up

lab-down:
	./hack/lab.sh down

# The lab cluster provisioned at the previous Kubernetes minor, then upgraded
# to the pinned one by reimaging, with the time of each phase (docs/lab.md,
# "make lab-upgrade"). Not part of make test: the previous minor's
# kube-tools are built from source once (30-40 min on 2 cores).
lab-upgrade: build
	./hack/lab.sh upgrade

# A ClusterClass change rolled in waves: examples/fleet-lab (class lab-store,
# three topology clusters, upgrade-wave 1-3) applied with kilnctl apply -R,
# then revision 2 of the class; its Rollout lab-store-r2 halts in wave 2 on
# an injected failure and completes after resume (docs/lab.md, "make
# lab-waves"). As root; not part of make test: three control planes roll one
# after another, >= 11-12 min on a quiet 2-core machine (17.5 min at load
# 28-52, 26 min at load 35-75), more than one test may take there.
lab-waves:
	KILN_E2E_WAVES=1 $(GO) test -count=1 -timeout 60m -run TestLabRolloutWaves -v ./e2e/fleet/

# A libvirt VM (TCG) booted by virtual media into the agent, laid with the
# golden image of lab VMs (examples/images/vm-lab.yaml), rebooted from disk
# and bootstrapped as a single-node control plane by the controller's own
# lifecycle, with its timeline (docs/lab.md, "make test-vm"). As root; not
# part of make test: under TCG it takes far longer than one test may there.
test-vm:
	KILN_E2E_VM=1 $(GO) test -count=1 -timeout 100m -run TestVMEndToEnd -v ./e2e/lab/domainbmc/

# The pinned Kubernetes release and its offline image archives, cached in
# $${KILN_CACHE:-/var/cache/kiln}/kube-tools (docs/kube-tools.md).
# KUBE_RELEASE=previous (or its version) builds the minor before instead.
kube-tools:
	./hack/kube-tools.sh $(if $(KUBE_RELEASE),--version $(KUBE_RELEASE))

# The full golden image (containerd, kubeadm/kubelet v1.34.4, staged
# control-plane images, the agent) into out/images (docs/imagebuilder.md).
image: kiln-agent kiln-imagebuilder
	$(BIN)/kiln-imagebuilder kube-tools
	$(BIN)/kiln-imagebuilder build -f examples/images/image-spec.yaml -o out/images

clean:
	rm -rf $(BIN)
