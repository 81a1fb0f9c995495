package seal

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// A rotation moves a key file from one key to another through two more
// files next to it, so that every key a stored value may be sealed under
// stays readable at every step, and a crash at any point is resumed by
// doing the next step again:
//
//	idle      KEY                    one key
//	prepared  KEY, KEY.next          the new key opens, the old one seals
//	switched  KEY (new), KEY.prev    the new key seals, the old one opens
//	idle      KEY (new)              once nothing is sealed under KEY.prev
//
// Switch makes KEY.prev a hard link of KEY and then renames KEY.next over
// KEY, so a crash between the two leaves KEY, KEY.next and KEY.prev with
// KEY and KEY.prev equal, which Switch completes.

// NextPath is the file of the key a rotation switches to.
func NextPath(path string) string { return path + ".next" }

// PrevPath is the file of the key a switched rotation retires.
func PrevPath(path string) string { return path + ".prev" }

// RotationState is the step of a rotation the key files are at.
type RotationState int

const (
	// Idle: the key file alone.
	Idle RotationState = iota
	// Prepared: a next key exists; the current key still seals.
	Prepared
	// Switched: the new key seals; the previous one is kept to open what
	// is not re-sealed yet.
	Switched
)

func (r RotationState) String() string {
	switch r {
	case Idle:
		return "idle"
	case Prepared:
		return "prepared"
	case Switched:
		return "switched"
	}
	return fmt.Sprintf("RotationState(%d)", int(r))
}

// ReadRotation returns the step of a rotation the key file at path is at.
// It returns FailedPrecondition for key files no rotation leaves behind
// (KEY.next and KEY.prev both there with KEY not equal to KEY.prev), and
// the errors of ReadKeyFile for a damaged file.
func ReadRotation(path string) (RotationState, error) {
	cur, err := readKey(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return 0, errdefs.FailedPrecondition("sealing key %s does not exist (check --secret-key-file)", path)
		}
		return 0, err
	}
	next, err := optionalKey(NextPath(path))
	if err != nil {
		return 0, err
	}
	prev, err := optionalKey(PrevPath(path))
	if err != nil {
		return 0, err
	}
	switch {
	case next == nil && prev == nil:
		return Idle, nil
	case next != nil && prev == nil:
		return Prepared, nil
	case next == nil && prev != nil:
		return Switched, nil
	case bytes.Equal(cur, prev): // Interrupted inside Switch.
		return Prepared, nil
	}
	return 0, errdefs.FailedPrecondition("sealing key %s: both %s and %s exist and the key file is neither: not a state a rotation leaves; restore the key files from backup", path, filepath.Base(NextPath(path)), filepath.Base(PrevPath(path)))
}

func optionalKey(path string) ([]byte, error) {
	k, err := readKey(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	return k, err
}

// Prepare makes sure a next key exists for the key file at path: it
// creates KEY.next (32 random bytes, 0600, written atomically) unless one
// is there, which it keeps (a retried step, or a key copied there from
// another replica). It returns the next key's id and whether it created
// it. It returns FailedPrecondition when the files are not idle or
// prepared.
func Prepare(path string) (KeyID, bool, error) {
	st, err := ReadRotation(path)
	if err != nil {
		return KeyID{}, false, err
	}
	if st == Switched {
		return KeyID{}, false, errdefs.FailedPrecondition("sealing key %s: a rotation is switched but not finished (%s exists): finish it first", path, filepath.Base(PrevPath(path)))
	}
	if next, err := optionalKey(NextPath(path)); err != nil || next != nil {
		return IDOf(next), false, err
	}
	cur, err := readKey(path)
	if err != nil {
		return KeyID{}, false, err
	}
	key, err := createKey(NextPath(path), IDOf(cur))
	clear(cur)
	if errors.Is(err, fs.ErrExist) {
		key, err = readKey(NextPath(path))
		return IDOf(key), false, err
	}
	if err != nil {
		return KeyID{}, false, err
	}
	return IDOf(key), true, syncDir(path)
}

// Switch makes the prepared next key the key file's key and keeps the
// previous one as KEY.prev. It is a no-op on switched files and returns
// FailedPrecondition on idle ones (nothing prepared).
//
// Equivalent to: `ln KEY KEY.prev && mv KEY.next KEY`.
func Switch(path string) error {
	st, err := ReadRotation(path)
	if err != nil {
		return err
	}
	switch st {
	case Switched:
		return nil
	case Idle:
		return errdefs.FailedPrecondition("sealing key %s: no next key to switch to (%s missing)", path, filepath.Base(NextPath(path)))
	}
	if err := os.Link(path, PrevPath(path)); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("sealing key %s: keep the previous key: %w", path, err)
	}
	if err := syncDir(path); err != nil {
		return err
	}
	if err := os.Rename(NextPath(path), path); err != nil {
		return fmt.Errorf("sealing key %s: switch to the next key: %w", path, err)
	}
	return syncDir(path)
}

// Retire removes KEY.prev, ending a switched rotation. Only call it once
// nothing stored is sealed under that key: values still sealed under it
// no longer open. It is a no-op when there is no KEY.prev and returns
// FailedPrecondition while a next key is pending.
//
// Equivalent to: `rm KEY.prev`.
func Retire(path string) error {
	st, err := ReadRotation(path)
	if err != nil {
		return err
	}
	switch st {
	case Idle:
		return nil
	case Prepared:
		return errdefs.FailedPrecondition("sealing key %s: the rotation is not switched yet", path)
	}
	if err := os.Remove(PrevPath(path)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("sealing key %s: retire the previous key: %w", path, err)
	}
	return syncDir(path)
}

// syncDir makes the renames, links and removals in path's directory
// durable.
func syncDir(path string) error {
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return fmt.Errorf("sealing key %s: %w", path, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sealing key %s: sync directory: %w", path, err)
	}
	return nil
}
