// Command laybench generates benchmark images and times agent/lay laying
// them from an HTTP server on loopback, for hack/bench/lay.sh.
//
//	laybench gen -dir DIR -size 1073741824 -data 20
//	laybench lay -image FILE -format raw|raw.zst -sha256 HEX -raw-size N -target FILE [-manifest M]
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
	"time"

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
	res, err := lay.New(log, lay.WithBufferSize(*bufSize), lay.WithFetchers(*fetchers), lay.WithWriters(*writers)).Lay(context.Background(), req, progress)
	if err != nil {
		return err
	}
	fmt.Printf("lay %.3f s fetched %d written %d\n", time.Since(start).Seconds(), res.GetBytesFetched(), res.GetBytesWritten())
	return nil
}
