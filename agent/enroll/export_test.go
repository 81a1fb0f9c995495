package enroll

// PendingKeyForTest exposes pendingKey to the external tests.
var PendingKeyForTest = pendingKey
