// Package conditions reads and writes the condition lists of resource
// status, with the rule that a condition's transition time changes only
// when its status does.
package conditions

import (
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Status values.
const (
	True    = "True"
	False   = "False"
	Unknown = "Unknown"
)

// Get returns the condition of type t, or nil.
func Get(list []*typesv1.Condition, t string) *typesv1.Condition {
	for _, c := range list {
		if c.GetType() == t {
			return c
		}
	}
	return nil
}

// IsTrue reports whether the condition of type t exists and is True.
func IsTrue(list []*typesv1.Condition, t string) bool {
	c := Get(list, t)
	return c != nil && c.GetStatus() == True
}

// Set puts c into list, replacing a condition of the same type. The last
// transition time is kept from the old condition when the status did not
// change, and set to now otherwise. It returns the new list and whether
// anything changed.
func Set(list []*typesv1.Condition, c *typesv1.Condition, now time.Time) ([]*typesv1.Condition, bool) {
	for i, old := range list {
		if old.GetType() != c.GetType() {
			continue
		}
		if old.GetStatus() == c.GetStatus() {
			c.LastTransitionTime = old.GetLastTransitionTime()
		} else {
			c.LastTransitionTime = timestamppb.New(now)
		}
		changed := old.GetStatus() != c.GetStatus() || old.GetReason() != c.GetReason() ||
			old.GetMessage() != c.GetMessage() || old.GetSeverity() != c.GetSeverity() ||
			old.GetObservedGeneration() != c.GetObservedGeneration()
		list[i] = c
		return list, changed
	}
	c.LastTransitionTime = timestamppb.New(now)
	return append(list, c), true
}

// New builds a condition.
func New(t, status, reason, message string) *typesv1.Condition {
	return &typesv1.Condition{Type: t, Status: status, Reason: reason, Message: message}
}

// Remove drops the condition of type t from list. It returns the new list
// and whether it held one.
func Remove(list []*typesv1.Condition, t string) ([]*typesv1.Condition, bool) {
	for i, c := range list {
		if c.GetType() == t {
			return append(list[:i:i], list[i+1:]...), true
		}
	}
	return list, false
}
