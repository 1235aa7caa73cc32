//go:build !linux

package redisstore

import "syscall"

// unreadBytes cannot ask the kernel on this platform: ok is false.
func unreadBytes(syscall.Conn) (int, bool) { return 0, false }
