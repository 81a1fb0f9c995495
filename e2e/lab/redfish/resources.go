package redfish

import (
	"net/http"
	"strings"
)

// The resource bodies below follow the DMTF public-rackmount1 mockup
// (fixtures/redfish-mockups/public-rackmount1), trimmed to what Kiln reads.

func odataID(id string) map[string]any { return map[string]any{"@odata.id": id} }

func collection(id, typ, name string, members []string) map[string]any {
	ms := make([]any, 0, len(members))
	for _, m := range members {
		ms = append(ms, odataID(m))
	}
	return map[string]any{
		"@odata.type":         "#" + typ + "." + typ,
		"@odata.id":           id,
		"Name":                name,
		"Members@odata.count": len(ms),
		"Members":             ms,
	}
}

func (b *BMC) serveVersions(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"v1": "/redfish/v1/"})
}

func (b *BMC) serveRoot(w http.ResponseWriter, r *http.Request) {
	root := map[string]any{
		"@odata.type":    "#ServiceRoot.v1_15_0.ServiceRoot",
		"@odata.id":      "/redfish/v1/",
		"Id":             "RootService",
		"Name":           "Root Service",
		"RedfishVersion": "1.15.0",
		"UUID":           "92384634-2938-2342-8820-489239905423",
		"Vendor":         "Kiln lab",
		"Product":        "Kiln Redfish emulator",
		"Systems":        odataID("/redfish/v1/Systems"),
		"Chassis":        odataID("/redfish/v1/Chassis"),
		"Managers":       odataID("/redfish/v1/Managers"),
		"SessionService": odataID("/redfish/v1/SessionService"),
		"Links": map[string]any{
			"Sessions": odataID("/redfish/v1/SessionService/Sessions"),
		},
	}
	if b.cfg.Auth == AuthBasicOnly {
		delete(root, "SessionService")
		root["Links"] = map[string]any{}
	}
	writeJSON(w, http.StatusOK, root)
}

func (b *BMC) serveSessionService(w http.ResponseWriter, r *http.Request) {
	if b.cfg.Auth == AuthBasicOnly {
		writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no resource at "+r.URL.Path)
		return
	}
	b.mu.Lock()
	timeout := int(b.cfg.SessionTimeout.Seconds())
	b.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{
		"@odata.type":    "#SessionService.v1_1_8.SessionService",
		"@odata.id":      "/redfish/v1/SessionService",
		"Id":             "SessionService",
		"Name":           "Session Service",
		"ServiceEnabled": true,
		"SessionTimeout": timeout,
		"Sessions":       odataID("/redfish/v1/SessionService/Sessions"),
	})
}

func (b *BMC) serveSessions(w http.ResponseWriter, r *http.Request) {
	b.mu.Lock()
	var ids []string
	for id := range b.sessions {
		ids = append(ids, "/redfish/v1/SessionService/Sessions/"+id)
	}
	b.mu.Unlock()
	writeJSON(w, http.StatusOK, collection("/redfish/v1/SessionService/Sessions", "SessionCollection", "Session Collection", ids))
}

func sessionJSON(id, user string) map[string]any {
	return map[string]any{
		"@odata.type": "#Session.v1_6_0.Session",
		"@odata.id":   "/redfish/v1/SessionService/Sessions/" + id,
		"Id":          id,
		"Name":        "User Session",
		"UserName":    user,
	}
}

func (b *BMC) serveSession(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("sid")
	b.mu.Lock()
	_, ok := b.sessions[id]
	b.mu.Unlock()
	if !ok {
		writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no session "+id)
		return
	}
	writeJSON(w, http.StatusOK, sessionJSON(id, b.cfg.Username))
}

func (b *BMC) serveSystems(w http.ResponseWriter, r *http.Request) {
	var ids []string
	for _, id := range b.order {
		ids = append(ids, "/redfish/v1/Systems/"+id)
	}
	writeJSON(w, http.StatusOK, collection("/redfish/v1/Systems", "ComputerSystemCollection", "Computer System Collection", ids))
}

func (b *BMC) serveSystem(w http.ResponseWriter, r *http.Request) {
	st := b.system(w, r)
	if st == nil {
		return
	}
	b.mu.Lock()
	on := b.reportedOnLocked(st, false)
	target, enabled, mode := st.target, st.enabled, st.mode
	b.mu.Unlock()
	power := "Off"
	if on {
		power = "On"
	}
	base := "/redfish/v1/Systems/" + st.cfg.ID
	writeJSON(w, http.StatusOK, map[string]any{
		"@odata.type":  "#ComputerSystem.v1_20_0.ComputerSystem",
		"@odata.id":    base,
		"Id":           st.cfg.ID,
		"Name":         st.cfg.Name,
		"SystemType":   st.cfg.SystemType,
		"Manufacturer": st.cfg.Manufacturer,
		"Model":        st.cfg.Model,
		"SerialNumber": st.cfg.SerialNumber,
		"UUID":         "38947555-7742-3448-3784-" + padID(st.cfg.ID),
		"Status":       map[string]any{"State": "Enabled", "Health": "OK"},
		"PowerState":   power,
		"Boot": map[string]any{
			"BootSourceOverrideEnabled":                        enabled,
			"BootSourceOverrideTarget":                         target,
			"BootSourceOverrideTarget@Redfish.AllowableValues": st.cfg.BootTargets,
			"BootSourceOverrideMode":                           mode,
		},
		"BiosVersion":        "P79 v1.45 (12/06/2017)",
		"ProcessorSummary":   map[string]any{"Count": 2, "Model": "Lab vCPU"},
		"MemorySummary":      map[string]any{"TotalSystemMemoryGiB": 4},
		"EthernetInterfaces": odataID(base + "/EthernetInterfaces"),
		"Links": map[string]any{
			"ManagedBy": []any{odataID("/redfish/v1/Managers/" + st.managerID)},
		},
		"Actions": map[string]any{
			"#ComputerSystem.Reset": map[string]any{
				"target": base + "/Actions/ComputerSystem.Reset",
				"ResetType@Redfish.AllowableValues": []string{
					"On", "ForceOff", "GracefulShutdown", "GracefulRestart",
					"ForceRestart", "PowerCycle", "Nmi", "ForceOn", "PushPowerButton",
				},
			},
		},
	})
}

func padID(id string) string {
	s := strings.Map(func(r rune) rune {
		if (r >= '0' && r <= '9') || (r >= 'a' && r <= 'f') {
			return r
		}
		return '0'
	}, strings.ToLower(id))
	s = strings.Repeat("0", 12) + s
	return s[len(s)-12:]
}

func (b *BMC) serveNICs(w http.ResponseWriter, r *http.Request) {
	st := b.system(w, r)
	if st == nil {
		return
	}
	base := "/redfish/v1/Systems/" + st.cfg.ID + "/EthernetInterfaces"
	var ids []string
	for i := range st.cfg.MACs {
		ids = append(ids, base+"/NIC"+itoa(i+1))
	}
	writeJSON(w, http.StatusOK, collection(base, "EthernetInterfaceCollection", "Ethernet Network Interface Collection", ids))
}

func (b *BMC) serveNIC(w http.ResponseWriter, r *http.Request) {
	st := b.system(w, r)
	if st == nil {
		return
	}
	nic := r.PathValue("nic")
	for i, mac := range st.cfg.MACs {
		if nic == "NIC"+itoa(i+1) {
			writeJSON(w, http.StatusOK, map[string]any{
				"@odata.type":         "#EthernetInterface.v1_6_0.EthernetInterface",
				"@odata.id":           "/redfish/v1/Systems/" + st.cfg.ID + "/EthernetInterfaces/" + nic,
				"Id":                  nic,
				"Name":                "Ethernet Interface",
				"MACAddress":          mac,
				"PermanentMACAddress": mac,
				"InterfaceEnabled":    true,
				"LinkStatus":          "LinkUp",
			})
			return
		}
	}
	writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no interface "+nic)
}

func (b *BMC) serveManagers(w http.ResponseWriter, r *http.Request) {
	var ids []string
	for _, id := range b.order {
		ids = append(ids, "/redfish/v1/Managers/"+b.systems[id].managerID)
	}
	writeJSON(w, http.StatusOK, collection("/redfish/v1/Managers", "ManagerCollection", "Manager Collection", ids))
}

func (b *BMC) serveManager(w http.ResponseWriter, r *http.Request) {
	st, _ := b.manager(w, r)
	if st == nil {
		return
	}
	base := "/redfish/v1/Managers/" + st.managerID
	body := map[string]any{
		"@odata.type":     "#Manager.v1_10_0.Manager",
		"@odata.id":       base,
		"Id":              st.managerID,
		"Name":            "Manager",
		"ManagerType":     "BMC",
		"Model":           "Joo Janta 200",
		"FirmwareVersion": b.cfg.FirmwareVersion,
		"PowerState":      "On",
		"Status":          map[string]any{"State": "Enabled", "Health": "OK"},
		"Links": map[string]any{
			"ManagerForServers": []any{odataID("/redfish/v1/Systems/" + st.cfg.ID)},
		},
	}
	if !b.cfg.NoVirtualMedia {
		body["VirtualMedia"] = odataID(base + "/VirtualMedia")
	}
	writeJSON(w, http.StatusOK, body)
}

func (b *BMC) serveMediaCollection(w http.ResponseWriter, r *http.Request) {
	st, _ := b.manager(w, r)
	if st == nil {
		return
	}
	base := "/redfish/v1/Managers/" + st.managerID + "/VirtualMedia"
	var ids []string
	if !b.cfg.NoVirtualMedia {
		ids = []string{base + "/CD1"}
	}
	writeJSON(w, http.StatusOK, collection(base, "VirtualMediaCollection", "Virtual Media Services", ids))
}

func (b *BMC) serveMedia(w http.ResponseWriter, r *http.Request) {
	st, ms := b.manager(w, r)
	if st == nil {
		return
	}
	if b.cfg.NoVirtualMedia {
		writeError(w, http.StatusNotFound, "Base.1.8.ResourceMissingAtURI", "no virtual media")
		return
	}
	b.mu.Lock()
	image, inserted := ms.image, ms.inserted
	b.mu.Unlock()
	base := "/redfish/v1/Managers/" + st.managerID + "/VirtualMedia/CD1"
	connected := "NotConnected"
	if inserted {
		connected = "URI"
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"@odata.type":    "#VirtualMedia.v1_3_0.VirtualMedia",
		"@odata.id":      base,
		"Id":             "CD1",
		"Name":           "Virtual CD",
		"MediaTypes":     []string{"CD", "DVD"},
		"Image":          image,
		"ImageName":      imageName(image),
		"ConnectedVia":   connected,
		"Inserted":       inserted,
		"WriteProtected": true,
		"Actions": map[string]any{
			"#VirtualMedia.InsertMedia": map[string]any{"target": base + "/Actions/VirtualMedia.InsertMedia"},
			"#VirtualMedia.EjectMedia":  map[string]any{"target": base + "/Actions/VirtualMedia.EjectMedia"},
		},
	})
}

func imageName(url string) string {
	if i := strings.LastIndex(url, "/"); i >= 0 {
		return url[i+1:]
	}
	return url
}

func itoa(i int) string {
	const digits = "0123456789"
	if i < 10 {
		return digits[i : i+1]
	}
	return itoa(i/10) + digits[i%10:i%10+1]
}
