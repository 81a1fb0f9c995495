//go:build !unix

package atomicfile

// syncDir does nothing where a directory cannot be opened for fsync
// (Windows): the rename is as durable as the filesystem makes it.
func syncDir(string) error { return nil }
