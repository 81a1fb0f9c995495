package redfish

import (
	"encoding/json"
	"net/http"
	"time"
)

// AdminPath is where an emulated BMC serves its fault-injection API, for
// lab tools in other processes. It takes the BMC's credentials (basic
// auth) and is not subject to the faults it sets:
//
//	GET    /kiln-lab/faults   current faults
//	PATCH  /kiln-lab/faults   set the fields given, e.g. {"failNext":3,"failStatus":503}
//	DELETE /kiln-lab/faults   ClearFaults
const AdminPath = "/kiln-lab/faults"

// Faults is the admin API's view of the injected faults.
type Faults struct {
	LatencyMS   *int64 `json:"latencyMs,omitempty"`
	FailNext    *int   `json:"failNext,omitempty"`
	FailStatus  *int   `json:"failStatus,omitempty"`
	MaxSessions *int   `json:"maxSessions,omitempty"`
	PowerLagMS  *int64 `json:"powerLagMs,omitempty"`
	PowerLies   *bool  `json:"powerLies,omitempty"`
}

func (b *BMC) faults() Faults {
	b.mu.Lock()
	defer b.mu.Unlock()
	lat, lag := b.latency.Milliseconds(), b.powerLag.Milliseconds()
	n, st, ms, lies := b.failN, b.failStatus, b.maxSessions, b.powerLies
	return Faults{LatencyMS: &lat, FailNext: &n, FailStatus: &st, MaxSessions: &ms, PowerLagMS: &lag, PowerLies: &lies}
}

func (b *BMC) serveAdmin(w http.ResponseWriter, r *http.Request) {
	if u, p, ok := r.BasicAuth(); !ok || u != b.cfg.Username || p != b.cfg.Password {
		writeError(w, http.StatusUnauthorized, "Base.1.8.InsufficientPrivilege", "admin API needs the BMC's credentials")
		return
	}
	switch r.Method {
	case http.MethodGet:
	case http.MethodDelete:
		b.ClearFaults()
	case http.MethodPatch, http.MethodPut, http.MethodPost:
		var f Faults
		if err := json.NewDecoder(r.Body).Decode(&f); err != nil {
			writeError(w, http.StatusBadRequest, "Base.1.8.MalformedJSON", "malformed faults")
			return
		}
		if f.LatencyMS != nil {
			b.SetLatency(time.Duration(*f.LatencyMS) * time.Millisecond)
		}
		if f.FailNext != nil {
			status := 0
			if f.FailStatus != nil {
				status = *f.FailStatus
			}
			b.FailNext(*f.FailNext, status)
		}
		if f.MaxSessions != nil {
			b.SetMaxSessions(*f.MaxSessions)
		}
		if f.PowerLagMS != nil {
			b.SetPowerLag(time.Duration(*f.PowerLagMS) * time.Millisecond)
		}
		if f.PowerLies != nil {
			b.SetPowerLies(*f.PowerLies)
		}
	default:
		writeError(w, http.StatusMethodNotAllowed, "Base.1.8.OperationNotAllowed", "use GET, PATCH or DELETE")
		return
	}
	writeJSON(w, http.StatusOK, b.faults())
}
