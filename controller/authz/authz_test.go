package authz

import "testing"

func TestAllowed(t *testing.T) {
	tests := []struct {
		role, method string
		want         bool
	}{
		{RoleReader, "/kiln.controller.v1.Resources/Get", true},
		{RoleReader, "/kiln.controller.v1.Resources/List", true},
		{RoleReader, "/kiln.controller.v1.Resources/Watch", true},
		{RoleReader, "/kiln.controller.v1.Resources/ListEvents", true},
		{RoleReader, "/kiln.controller.v1.Resources/ListControllers", true},
		{RoleAgent, "/kiln.controller.v1.Resources/ListControllers", false},
		{RoleReader, "/kiln.controller.v1.Resources/Apply", false},
		{RoleReader, "/kiln.controller.v1.Resources/Delete", false},
		{RoleReader, "/kiln.controller.v1.Resources/CreateToken", false},
		{RoleOperator, "/kiln.controller.v1.Resources/Apply", true},
		{RoleOperator, "/kiln.controller.v1.Resources/CreateToken", true},
		{RoleOperator, "/kiln.controller.v1.Resources/GetKubeconfig", false},
		{RoleReader, "/kiln.controller.v1.Resources/GetKubeconfig", false},
		{RoleAdmin, "/kiln.controller.v1.Resources/GetKubeconfig", true},
		{RoleAdmin, "/kiln.controller.v1.Resources/ListAudit", true},
		{RoleOperator, "/kiln.controller.v1.Resources/ListAudit", false},
		{RoleReader, "/kiln.controller.v1.Resources/ListAudit", false},
		{RoleAdmin, "/kiln.controller.v1.Resources/Delete", true},
		{RoleAdmin, "/kiln.controller.v1.Agents/Heartbeat", false},
		{RoleAgent, "/kiln.controller.v1.Agents/Heartbeat", true},
		{RoleAgent, "/kiln.controller.v1.Agents/Renew", true},
		{RoleAgent, "/kiln.controller.v1.Resources/Get", false},
		{RoleController, "/kiln.controller.v1.Resources/Get", false},
		{RoleController, "/kiln.controller.v1.Agents/Heartbeat", false},
		{RoleAnonymous, "/kiln.controller.v1.Enrollment/Enroll", true},
		{RoleAnonymous, "/kiln.controller.v1.Resources/Get", false},
		{RoleAnonymous, "/kiln.controller.v1.Agents/Heartbeat", false},
		{RoleAdmin, "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", false},
		{"superuser", "/kiln.controller.v1.Resources/Get", false},
	}
	for _, tt := range tests {
		if got := Allowed(tt.role, tt.method); got != tt.want {
			t.Errorf("Allowed(%q, %q) = %v, want %v", tt.role, tt.method, got, tt.want)
		}
	}
}

func TestGetKubeconfigIsAdminOnly(t *testing.T) {
	const m = "/kiln.controller.v1.Resources/GetKubeconfig"
	for role, want := range map[string]bool{
		RoleAdmin: true, RoleOperator: false, RoleReader: false,
		RoleAgent: false, RoleController: false, RoleAnonymous: false,
	} {
		if got := Allowed(role, m); got != want {
			t.Errorf("Allowed(%q, GetKubeconfig) = %v, want %v", role, got, want)
		}
	}
}

func TestNeeded(t *testing.T) {
	tests := []struct{ method, want string }{
		{"/kiln.controller.v1.Resources/GetKubeconfig", "the admin role"},
		{"/kiln.controller.v1.Resources/Apply", "the operator or admin role"},
		{"/kiln.controller.v1.Resources/CreateToken", "the operator or admin role"},
		{"/kiln.controller.v1.Resources/Get", "the reader, operator or admin role"},
		{"/kiln.controller.v1.Agents/Heartbeat", "an agent certificate"},
		{"/kiln.controller.v1.Enrollment/Enroll", ""},
		{"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", ""},
	}
	for _, tt := range tests {
		if got := Needed(tt.method); got != tt.want {
			t.Errorf("Needed(%q) = %q, want %q", tt.method, got, tt.want)
		}
	}
}

func TestGrantAuditRead(t *testing.T) {
	a := New(nil)
	if err := a.GrantAuditRead("operator", "reader:alice"); err != nil {
		t.Fatalf("GrantAuditRead = %v", err)
	}
	const m = "/kiln.controller.v1.Resources/ListAudit"
	tests := []struct {
		c    Caller
		want bool
	}{
		{Caller{Role: RoleAdmin, Name: "root"}, true},
		{Caller{Role: RoleOperator, Name: "olga"}, true},
		{Caller{Role: RoleReader, Name: "alice"}, true},
		{Caller{Role: RoleReader, Name: "bob"}, false},
		{Caller{Role: RoleAgent, Name: "alice"}, false},
		{Caller{Role: RoleAnonymous}, false},
	}
	for _, tt := range tests {
		if got := a.allowed(tt.c, m); got != tt.want {
			t.Errorf("allowed(%v, ListAudit) = %v, want %v", tt.c, got, tt.want)
		}
	}
	// A grant opens the audit log only, nothing else.
	if a.allowed(Caller{Role: RoleReader, Name: "alice"}, "/kiln.controller.v1.Resources/Apply") {
		t.Errorf("allowed(reader alice, Apply) = true, want false")
	}
	for _, bad := range []string{"agent", "reader:", "root"} {
		if err := New(nil).GrantAuditRead(bad); err == nil {
			t.Errorf("GrantAuditRead(%q) = nil, want an error", bad)
		}
	}
}

// TestMoveIsAdminOnly: the calls of kilnctl move stop, replace or read the
// whole controller: an admin only, never an operator, reader, agent,
// controller or anonymous caller.
func TestMoveIsAdminOnly(t *testing.T) {
	for _, m := range []string{"Pause", "Resume", "GetPause", "Adopt", "Inventory", "Backup"} {
		method := "/kiln.controller.v1.Maintenance/" + m
		for role, want := range map[string]bool{
			RoleAdmin: true, RoleOperator: false, RoleReader: false,
			RoleAgent: false, RoleController: false, RoleAnonymous: false,
		} {
			if got := Allowed(role, method); got != want {
				t.Errorf("Allowed(%q, %q) = %v, want %v", role, method, got, want)
			}
		}
	}
}
