package redisstore

import (
	"syscall"
	"unsafe"
)

// unreadBytes is how many bytes the kernel holds received and not yet read
// on c's socket (FIONREAD); ok is false when that cannot be asked.
func unreadBytes(c syscall.Conn) (n int, ok bool) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, false
	}
	var v int32
	var errno syscall.Errno
	if err := rc.Control(func(fd uintptr) {
		_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, syscall.TIOCINQ, uintptr(unsafe.Pointer(&v)))
	}); err != nil || errno != 0 {
		return 0, false
	}
	return int(v), true
}
