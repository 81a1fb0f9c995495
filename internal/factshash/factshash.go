// Package factshash names a host's facts by a hash, so an agent can tell
// its controller "my facts are still these" in 64 bytes instead of
// sending them, and the controller can tell that nothing changed without
// comparing them field by field.
package factshash

import (
	"crypto/sha256"
	"encoding/hex"

	"google.golang.org/protobuf/proto"

	typesv1 "github.com/kilnhq/kiln/proto/kiln/types/v1"
)

// Sum is the hex sha256 of f's deterministic protobuf encoding, or "" for
// nil facts. Equal facts give equal sums within one build; across builds
// the encoding may differ, which costs the controller one more request
// for the facts, never a wrong answer: it stores the sum the agent sent
// with the facts and compares the agent's sums only with the agent's.
func Sum(f *typesv1.Facts) string {
	if f == nil {
		return ""
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(f)
	if err != nil {
		// Facts are plain data; marshalling cannot fail. An empty sum
		// makes the controller ask for the facts, the safe answer.
		return ""
	}
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}
