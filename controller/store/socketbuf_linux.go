package store

import (
	"net"

	"golang.org/x/sys/unix"
)

// setSocketBuffers sets c's send and receive buffers to n bytes: forced
// past net.core.wmem_max and rmem_max when the process may
// (CAP_NET_ADMIN), else as large as those allow. It is best effort: a
// socket keeps its default when both fail.
func setSocketBuffers(c *net.UnixConn, n int) {
	raw, err := c.SyscallConn()
	if err != nil {
		return
	}
	_ = raw.Control(func(fd uintptr) {
		for _, o := range [][2]int{{unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}, {unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}} {
			if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[0], n) != nil {
				_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[1], n)
			}
		}
	})
}
