package manifest

// Test helpers shared with the external test package (load_test.go).

var (
	GoodCluster = goodCluster
	HostsYAML   = hostsYAML
)

// checkDocument validates a decoded document for FuzzDecode; set by the
// external test package, which may import controller/validation.
var checkDocument func(*Document, *Error)

// SetCheckDocument sets the validation FuzzDecode runs on what decodes.
func SetCheckDocument(f func(*Document, *Error)) { checkDocument = f }
