package bmc

import (
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"

	"github.com/stmcginnis/gofish/common"

	"github.com/kilnhq/kiln/internal/errdefs"
)

// explain translates an error from bmclib or gofish into Kiln's error
// vocabulary, with a message that says what the BMC answered (status code
// and Redfish MessageId where there is one) and what to try. Errors that
// already carry an errdefs class, and transport errors (which classify
// handles), are returned unchanged. The password is redacted later, by
// classify.
func (d *redfishDriver) explain(err error) error {
	if err == nil || classed(err) {
		return err
	}
	method := d.authInUse()
	svc := "redfish service at " + d.base()
	user := d.ep.Username

	rfe, at := redfishError(err)
	if rfe != nil && rfe.HTTPReturnedStatusCode != 0 {
		code := rfe.HTTPReturnedStatusCode
		answer := describeAnswer(rfe)
		if at != "" {
			answer += ", on " + at
		}
		switch {
		case code == http.StatusUnauthorized && method == "":
			// auto reads the service root without credentials, as gofish
			// does before it logs in.
			return errdefs.PermissionDenied("%s refused to serve its service root /redfish/v1/ without credentials (%s): Redfish (DSP0266) serves it to anyone; Kiln cannot log in to this service", svc, answer)
		case code == http.StatusUnauthorized && method == AuthBasic:
			hint := "check spec.bmc.username and password"
			if !d.isAuto() {
				hint += ", or set spec.bmc.auth to auto or session"
			}
			return errdefs.PermissionDenied("%s refused basic authentication for user %q (%s): %s", svc, user, answer, hint)
		case code == http.StatusUnauthorized:
			return errdefs.PermissionDenied("%s refused the session login of user %q (%s): check spec.bmc.username and password", svc, user, answer)
		case code == http.StatusForbidden:
			return errdefs.PermissionDenied("%s denied user %q this request (%s): give the user a role that may do it (Operator or Administrator)", svc, user, answer)
		case code == http.StatusNotFound:
			return errdefs.NotFound("%s has no such resource (%s)", svc, answer)
		case code == http.StatusMethodNotAllowed || code == http.StatusNotImplemented:
			return errdefs.NotSupported("%s does not support this request (%s)", svc, answer)
		case code == http.StatusTooManyRequests || code >= 500:
			if ra := d.transport.peek(); ra > 0 {
				answer += fmt.Sprintf("; Retry-After %s", ra)
			}
			return errdefs.Unavailable("%s is busy or failing (%s)", svc, answer)
		case code >= 400:
			return errdefs.InvalidArgument("%s rejected the request (%s)", svc, answer)
		}
	}

	msg := err.Error()
	switch {
	case strings.Contains(msg, "no target provided"):
		// gofish's session login POSTs to the root's Links.Sessions,
		// which a service without a SessionService does not have.
		return errdefs.FailedPrecondition("%s has no SessionService (its service root links no Sessions), so session authentication cannot work: set spec.bmc.auth to basic or auto", svc)
	case strings.Contains(msg, "not authenticated"):
		// bmclib checks its session before each request; gofish says
		// "client not authenticated" when the login left it none.
		return errdefs.PermissionDenied("%s did not authenticate user %q (no session after login: %s): check spec.bmc.username and password, or set spec.bmc.auth to basic", svc, user, msg)
	case strings.Contains(msg, "no virtual media found"):
		return errdefs.NotSupported("%s has no virtual media (none under the Manager or the System): boot this host by PXE", svc)
	}
	return err
}

// redfishError finds the Redfish error answer in err: err itself, or the
// first failure (by link) of a gofish collection read, with its link.
func redfishError(err error) (*common.Error, string) {
	var rfe *common.Error
	if errors.As(err, &rfe) {
		return rfe, ""
	}
	var ce *common.CollectionError
	if errors.As(err, &ce) {
		links := make([]string, 0, len(ce.Failures))
		for l := range ce.Failures {
			links = append(links, l)
		}
		sort.Strings(links)
		for _, l := range links {
			if errors.As(ce.Failures[l], &rfe) {
				return rfe, l
			}
		}
	}
	return nil, ""
}

// describeAnswer renders a Redfish error answer as "401 Base.1.8.NoValidSession:
// message", or the status code and a short body when it is not Redfish.
func describeAnswer(e *common.Error) string {
	id, text := e.Code, e.Message
	for _, x := range e.ExtendedInfos {
		if x.MessageID != "" {
			id = x.MessageID
			if x.Message != "" {
				text = x.Message
			}
			break
		}
	}
	text = strings.TrimSpace(text)
	if len(text) > 200 {
		text = text[:200] + "..."
	}
	switch {
	case id != "" && text != "":
		return fmt.Sprintf("%d %s: %s", e.HTTPReturnedStatusCode, id, text)
	case id != "":
		return fmt.Sprintf("%d %s", e.HTTPReturnedStatusCode, id)
	case text != "":
		return fmt.Sprintf("%d: %s", e.HTTPReturnedStatusCode, text)
	}
	return fmt.Sprintf("%d %s", e.HTTPReturnedStatusCode, http.StatusText(e.HTTPReturnedStatusCode))
}

// classed reports whether err already carries an errdefs class.
func classed(err error) bool {
	return errdefs.IsUnavailable(err) || errdefs.IsNotSupported(err) || errdefs.IsInvalidArgument(err) ||
		errdefs.IsNotFound(err) || errdefs.IsFailedPrecondition(err) || errdefs.IsPermissionDenied(err) ||
		errdefs.IsAlreadyExists(err) || errdefs.IsConflict(err)
}
