//go:build unix

package atomicfile

import "os"

// syncDir fsyncs directory dir, making the renames and links in it
// durable. Equivalent to: `sync DIR`.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
