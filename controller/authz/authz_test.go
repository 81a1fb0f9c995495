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
		{RoleReader, "/kiln.controller.v1.Resources/Apply", false},
		{RoleReader, "/kiln.controller.v1.Resources/Delete", false},
		{RoleReader, "/kiln.controller.v1.Resources/CreateToken", false},
		{RoleOperator, "/kiln.controller.v1.Resources/Apply", true},
		{RoleOperator, "/kiln.controller.v1.Resources/CreateToken", true},
		{RoleOperator, "/kiln.controller.v1.Resources/GetKubeconfig", false},
		{RoleReader, "/kiln.controller.v1.Resources/GetKubeconfig", false},
		{RoleAdmin, "/kiln.controller.v1.Resources/GetKubeconfig", true},
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
