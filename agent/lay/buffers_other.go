//go:build !linux

package lay

import "errors"

// mapSlab: the arena uses the heap on this platform.
func mapSlab(int) ([]byte, error) { return nil, errors.New("not mapped on this platform") }

func unmapSlab([]byte) {}
