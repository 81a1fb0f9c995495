// Command debpkg builds Kiln's Debian packages from built binaries
// (internal/debpkg); `make packages` runs it:
//
//	go run ./hack/debpkg -bin bin -out out/packages -describe "$(git describe --tags --always --dirty)"
//
// The time stamp of every file is SOURCE_DATE_EPOCH (make packages sets
// it to the commit time), so two builds of one commit are identical.
package main

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/kilnhq/kiln/internal/debpkg"
)

func main() {
	bin := flag.String("bin", "bin", "directory of the built binaries")
	out := flag.String("out", "out/packages", "directory to write the .deb files to")
	describe := flag.String("describe", "", "git describe --tags --always --dirty output, turned into the Debian version")
	version := flag.String("version", "", "Debian version to use as is (instead of -describe)")
	flag.Parse()
	if err := run(*bin, *out, *describe, *version); err != nil {
		fmt.Fprintln(os.Stderr, "debpkg:", err)
		os.Exit(1)
	}
}

func run(bin, out, describe, version string) error {
	epoch := os.Getenv("SOURCE_DATE_EPOCH")
	if epoch == "" {
		return fmt.Errorf("SOURCE_DATE_EPOCH is not set: set it to the commit time (git log -1 --format=%%ct)")
	}
	sec, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil {
		return fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", epoch, err)
	}
	mtime := time.Unix(sec, 0).UTC()
	if version == "" {
		if version, err = debpkg.DebVersion(describe, mtime); err != nil {
			return err
		}
	}
	paths, err := debpkg.Build(debpkg.Options{BinDir: bin, OutDir: out, Version: version, MTime: mtime})
	if err != nil {
		return err
	}
	for _, p := range paths {
		fmt.Println(p)
	}
	return nil
}
