//go:build linux

// Command laybench generates benchmark images and times agent/lay laying
// them from an HTTP server on loopback, for hack/bench/lay.sh.
//
//	laybench gen -dir DIR -size 1073741824 -data 20
//	laybench lay -image FILE -format raw|raw.zst -sha256 HEX -raw-size N -target FILE [-manifest M]
//	laybench writes -manifest M -target FILE [-writers 4] [-fallocate=true]
//
// writes measures the disk's part alone: it writes the manifest's ranges
// (from memory, no fetching or hashing) onto a new target the way a
// block-map lay does (O_DIRECT, several writes in flight, ranges
// preallocated, one fsync), the floor under kiln-lay's time.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime/pprof"
	"runtime/trace"
	"syscall"
	"time"
	"unsafe"

	"github.com/kilnhq/kiln/agent/lay"
	"github.com/kilnhq/kiln/imagebuilder/manifest"
	agentv1 "github.com/kilnhq/kiln/proto/kiln/agent/v1"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: laybench gen|lay [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "gen":
		err = gen(os.Args[2:])
	case "lay":
		err = layCmd(os.Args[2:])
	case "writes":
		err = writesCmd(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "laybench:", err)
		os.Exit(1)
	}
}

// gen writes DIR/dense.raw (random bytes), DIR/sparse.raw (data% of it in
// 1 MiB runs of random bytes, the rest holes) and DIR/sparse.json, the
// manifest with its block map.
func gen(args []string) error {
	fs := flag.NewFlagSet("gen", flag.ExitOnError)
	dir := fs.String("dir", ".", "output directory")
	size := fs.Int64("size", 1<<30, "image size in bytes")
	data := fs.Int("data", 20, "percent of the sparse image that holds data")
	fs.Parse(args)

	r := rand.NewChaCha8([32]byte{1})
	buf := make([]byte, 1<<20)
	dense, err := os.Create(filepath.Join(*dir, "dense.raw"))
	if err != nil {
		return err
	}
	for off := int64(0); off < *size; off += int64(len(buf)) {
		r.Read(buf)
		if _, err := dense.Write(buf[:min(int64(len(buf)), *size-off)]); err != nil {
			return err
		}
	}
	if err := dense.Close(); err != nil {
		return err
	}

	sparse, err := os.Create(filepath.Join(*dir, "sparse.raw"))
	if err != nil {
		return err
	}
	if err := sparse.Truncate(*size); err != nil {
		return err
	}
	stride := int64(len(buf)) * 100 / int64(*data) // one 1 MiB run per stride
	for off := int64(0); off+int64(len(buf)) <= *size; off += stride {
		r.Read(buf)
		if _, err := sparse.WriteAt(buf, off); err != nil {
			return err
		}
	}
	if err := sparse.Close(); err != nil {
		return err
	}
	for _, name := range []string{"dense", "sparse"} {
		if err := writeManifest(filepath.Join(*dir, name+".raw"), filepath.Join(*dir, name+".json")); err != nil {
			return err
		}
	}
	return nil
}

// writeManifest writes the manifest, with its block map, of a raw image.
func writeManifest(image, path string) error {
	ranges, err := manifest.BlockMap(context.Background(), image, manifest.DefaultBlockSize)
	if err != nil {
		return err
	}
	sum, err := fileSHA256(image)
	if err != nil {
		return err
	}
	fi, err := os.Stat(image)
	if err != nil {
		return err
	}
	m := &manifest.Manifest{
		Tag: "bench-" + filepath.Base(image), Format: manifest.FormatRaw, RawSize: uint64(fi.Size()), RawSHA256: sum,
		BlockSize: manifest.DefaultBlockSize, BlockMap: ranges, BuildDate: time.Now().UTC(),
	}
	fmt.Printf("%s: %d ranges, %d data bytes of %d\n", image, len(ranges), m.DataSize(), fi.Size())
	return manifest.Write(path, m)
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// layCmd serves -image on a loopback port and lays it onto -target,
// printing the time Lay took.
func layCmd(args []string) error {
	fs := flag.NewFlagSet("lay", flag.ExitOnError)
	image := fs.String("image", "", "image file to serve")
	format := fs.String("format", "raw", "raw or raw.zst")
	sum := fs.String("sha256", "", "sha256 of the image file")
	rawSize := fs.Uint64("raw-size", 0, "size of the raw image")
	target := fs.String("target", "", "file or device to lay onto")
	man := fs.String("manifest", "", "manifest whose block map to use")
	verbose := fs.Bool("v", false, "print each step with its time")
	bufSize := fs.Int("buffer", 1<<20, "pipeline buffer size")
	fetchers := fs.Int("fetchers", 4, "parallel block-map fetchers")
	writers := fs.Int("writers", 4, "writes in flight")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile")
	traceFile := fs.String("trace", "", "write an execution trace (go tool trace)")
	fs.Parse(args)
	if *traceFile != "" {
		f, err := os.Create(*traceFile)
		if err != nil {
			return err
		}
		trace.Start(f)
		defer trace.Stop()
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			return err
		}
		pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	if *image == "" || *target == "" {
		return errors.New("-image and -target are required")
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer ln.Close()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.ServeFile(w, r, *image)
	})}
	go srv.Serve(ln)
	defer srv.Close()

	req := &agentv1.LayImageRequest{
		Url: "http://" + ln.Addr().String() + "/" + filepath.Base(*image), Sha256: *sum,
		Format: *format, Target: *target, RawSize: *rawSize,
	}
	if *man != "" {
		m, err := manifest.Read(*man)
		if err != nil {
			return err
		}
		req = m.LayRequest(req.Url, req.Target, true)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	start := time.Now()
	var progress func(*agentv1.Progress)
	if *verbose {
		last := ""
		progress = func(p *agentv1.Progress) {
			if p.GetStep() != last {
				fmt.Fprintf(os.Stderr, "%7.3f s %s\n", time.Since(start).Seconds(), p.GetStep())
				last = p.GetStep()
			}
		}
	}
	res, err := lay.New(log, lay.WithFileTargets(true), lay.WithBufferSize(*bufSize), lay.WithFetchers(*fetchers), lay.WithWriters(*writers)).Lay(context.Background(), req, progress)
	if err != nil {
		return err
	}
	fmt.Printf("lay %.3f s fetched %d written %d\n", time.Since(start).Seconds(), res.GetBytesFetched(), res.GetBytesWritten())
	return nil
}

// writesCmd writes the ranges of a manifest's block map onto a new target
// with O_DIRECT from -writers goroutines, after preallocating them, then
// fsyncs, and prints the time from creating the target to the fsync.
func writesCmd(args []string) error {
	fs := flag.NewFlagSet("writes", flag.ExitOnError)
	man := fs.String("manifest", "", "manifest whose block map to write")
	target := fs.String("target", "", "file to create")
	writers := fs.Int("writers", 4, "writes in flight")
	prealloc := fs.Bool("fallocate", true, "preallocate the ranges first, as agent/lay does")
	fs.Parse(args)
	if *man == "" || *target == "" {
		return errors.New("-manifest and -target are required")
	}
	m, err := manifest.Read(*man)
	if err != nil {
		return err
	}
	start := time.Now()
	f, err := os.OpenFile(*target, os.O_CREATE|os.O_EXCL|os.O_RDWR|syscall.O_DIRECT, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(int64(m.RawSize)); err != nil {
		return err
	}
	if *prealloc {
		for _, r := range m.BlockMap {
			if err := syscall.Fallocate(int(f.Fd()), 1 /* FALLOC_FL_KEEP_SIZE */, int64(r.Offset), int64(r.Length)); err != nil {
				return err
			}
		}
	}
	const chunk = 1 << 20
	type piece struct{ off, n int64 }
	work := make(chan piece, 1024)
	go func() {
		defer close(work)
		for _, r := range m.BlockMap {
			for off := int64(r.Offset); off < int64(r.Offset+r.Length); off += chunk {
				work <- piece{off, min(chunk, int64(r.Offset+r.Length)-off)}
			}
		}
	}()
	errs := make(chan error, *writers)
	for range *writers {
		go func() {
			raw := make([]byte, chunk+4096)
			buf := raw[4096-int(uintptr(unsafe.Pointer(&raw[0]))%4096):][:chunk] // O_DIRECT alignment
			rand.NewChaCha8([32]byte{3}).Read(buf)
			for p := range work {
				if _, err := f.WriteAt(buf[:p.n], p.off); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range *writers {
		if err := <-errs; err != nil {
			return err
		}
	}
	if err := f.Sync(); err != nil {
		return err
	}
	fmt.Printf("writes %.3f s (%d ranges, %d bytes, %d writers, fallocate %v)\n", time.Since(start).Seconds(), len(m.BlockMap), m.DataSize(), *writers, *prealloc)
	return nil
}
