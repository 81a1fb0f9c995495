//go:build !unix

package bootmedia

import "context"

// lockFile does nothing where flock is missing: concurrent fetches of one
// kernel still publish by rename, but may download it twice.
func lockFile(context.Context, string) (func(), error) { return func() {}, nil }
