//go:build !linux

package store

import "net"

func setSocketBuffers(c *net.UnixConn, n int) {
	_ = c.SetWriteBuffer(n)
	_ = c.SetReadBuffer(n)
}
