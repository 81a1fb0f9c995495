// Package version holds the build's version, set by the linker.
package version

// Version is set with -ldflags "-X github.com/kilnhq/kiln/internal/version.Version=...".
var Version = "dev"
