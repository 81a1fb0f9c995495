package netns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kilnhq/kiln/e2e/lab/nspawn"
	"github.com/kilnhq/kiln/internal/errdefs"
)

// ip runs the ip tool.
func ip(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// ProcessID names a running process so that it can be told apart from a
// later process with the same PID: "PID:STARTTIME" (start time in clock
// ticks since boot, field 22 of /proc/PID/stat). It returns "PID:0" when
// the process is gone.
func ProcessID(pid int) string {
	return fmt.Sprintf("%d:%d", pid, startTime(pid))
}

func startTime(pid int) uint64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// comm (field 2) may hold spaces: count from the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return 0
	}
	n, _ := strconv.ParseUint(f[19], 10, 64)
	return n
}

// ProcessAlive reports whether the process id (from ProcessID) still
// runs: same PID, same start time, not a zombie.
func ProcessAlive(id string) bool {
	pid, st, ok := parseProcessID(id)
	return ok && st != 0 && startTime(pid) == st && state(pid) != "Z"
}

func parseProcessID(id string) (pid int, start uint64, ok bool) {
	a, b, found := strings.Cut(id, ":")
	if !found {
		return 0, 0, false
	}
	p, err1 := strconv.Atoi(a)
	s, err2 := strconv.ParseUint(b, 10, 64)
	return p, s, err1 == nil && err2 == nil && p > 0
}

// KillProcess kills the process id (from ProcessID) with SIGKILL if it
// is still the same process, and waits up to 5 s for it to go. A process
// that is gone is not an error.
func KillProcess(id string) error {
	pid, st, ok := parseProcessID(id)
	if !ok {
		return errdefs.InvalidArgument("process id %q: want PID:STARTTIME", id)
	}
	if st == 0 || startTime(pid) != st {
		return nil
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for range 50 {
		if startTime(pid) != st {
			return nil
		}
		// A zombie of ours is reaped by its waiter; one of a dead parent by init.
		if state(pid) == "Z" {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return errdefs.Unavailable("process %d did not exit after SIGKILL", pid)
}

func state(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+3 > len(s) {
		return ""
	}
	return s[i+2 : i+3]
}

// mountSource is the source device of the mount at dir, "" when dir is
// not a mount point.
func mountSource(dir string) string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return ""
	}
	defer f.Close()
	src := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPER
		fields := strings.Fields(sc.Text())
		if len(fields) < 10 || unescape(fields[4]) != dir {
			continue
		}
		for i, x := range fields {
			if x == "-" && i+2 < len(fields) {
				src = fields[i+2] // the last mount on dir wins
			}
		}
	}
	return src
}

// unescape undoes mountinfo's octal escapes (\040 for a space).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Mounted reports whether dir is a mount point.
func Mounted(dir string) bool { return mountSource(dir) != "" }

// Unmount unmounts dir and everything below it; a dir that is not mounted
// is not an error. Equivalent to `umount -R DIR` (lazily, `umount -R -l`,
// when busy).
func Unmount(ctx context.Context, dir string) error {
	if !Mounted(dir) {
		return nil
	}
	out, err := exec.CommandContext(ctx, "umount", "-R", dir).CombinedOutput()
	if err != nil {
		out2, err2 := exec.CommandContext(ctx, "umount", "-R", "-l", dir).CombinedOutput()
		if err2 != nil {
			return fmt.Errorf("umount %s: %v: %s; lazily: %s", dir, err, strings.TrimSpace(string(out)), strings.TrimSpace(string(out2)))
		}
	}
	return nil
}

// DetachLoop detaches the loop device when it is still attached to the
// file backing. Equivalent to `losetup -d LOOP`.
func DetachLoop(ctx context.Context, loop, backing string) error {
	name := filepath.Base(loop)
	var bf []byte
	var err error
	for range 20 { // autoclear detaches right after the last unmount
		bf, err = os.ReadFile(filepath.Join("/sys/block", name, "loop/backing_file"))
		if err != nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	if strings.TrimSuffix(strings.TrimSpace(string(bf)), " (deleted)") != backing {
		return nil
	}
	out, err := exec.CommandContext(ctx, "losetup", "-d", loop).CombinedOutput()
	if err != nil {
		return fmt.Errorf("losetup -d %s: %w: %s", loop, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// DetachLoops waits (up to 5 s) for the loop devices backed by file to
// go away, as autoclear loop devices do once their last mount is gone,
// then detaches those still attached. Equivalent to `losetup -j FILE`
// and `losetup -d LOOP`.
func DetachLoops(ctx context.Context, file string) error {
	var loops []string
	for range 50 {
		loops = loopsOf(file)
		if len(loops) == 0 {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	var errs []error
	for _, l := range loops {
		if out, err := exec.CommandContext(ctx, "losetup", "-d", l).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("losetup -d %s: %w: %s", l, err, strings.TrimSpace(string(out))))
		}
	}
	return errors.Join(errs...)
}

// loopsOf lists the loop devices whose backing file is file.
func loopsOf(file string) []string {
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var loops []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)") == file {
			loops = append(loops, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return loops
}

// Remove undoes one resource a machine (or the rack) created: kills a
// process, unmounts, detaches a loop device, removes a cgroup, a
// directory, a network namespace or a link. Resources that are already
// gone are not an error, so Remove can run again after a partial
// teardown.
func Remove(ctx context.Context, r Resource) error {
	switch r.Kind {
	case KindPID:
		return KillProcess(r.Value)
	case KindMount:
		return Unmount(ctx, r.Value)
	case KindLoop:
		loop, backing, _ := strings.Cut(r.Value, "=")
		return DetachLoop(ctx, loop, backing)
	case KindCgroup:
		nspawn.KillCgroup(r.Value)
		return nspawn.RemoveCgroup(r.Value)
	case KindDir:
		return os.RemoveAll(r.Value)
	case KindNetns:
		if _, err := os.Stat("/run/netns/" + r.Value); err != nil {
			return nil
		}
		return ip(ctx, "netns", "del", r.Value)
	case KindLink:
		if _, err := os.Stat("/sys/class/net/" + r.Value); err != nil {
			return nil
		}
		// A veth goes away with its peer's namespace, asynchronously: it may
		// vanish between the stat and the delete, and ip says so either as
		// "Cannot find device" or as RTNETLINK's "No such device".
		if err := ip(ctx, "link", "del", r.Value); err != nil && !linkGone(err) {
			return err
		}
		return nil
	}
	return errdefs.InvalidArgument("resource kind %q unknown", r.Kind)
}

// linkGone reports whether ip's error says the link does not exist (any
// more).
func linkGone(err error) bool {
	return strings.Contains(err.Error(), "Cannot find device") || strings.Contains(err.Error(), "No such device")
}
