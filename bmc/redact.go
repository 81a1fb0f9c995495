package bmc

import (
	"encoding/base64"
	"encoding/json"
	"net/url"
	"regexp"
	"strings"
)

const redacted = "<redacted>"

// redact removes the password secret from s where it stands as a
// credential, and nowhere else, so that a short or common password
// ("p", "redfish", "password") neither mangles the message
// ("htt<redacted>://") nor tells a reader what it is. The credential forms
// are the ones a BMC or a library may echo back:
//
//   - a JSON field named Password (a session login body),
//   - a form or query field password=..., pass=..., pw=...,
//   - user:secret (URL userinfo, "basic=user:secret"), for the endpoint's
//     user and, before '@', for any user,
//   - the Authorization header's Basic token for user:secret.
func redact(s, user, secret string) string {
	if secret == "" || s == "" {
		return s
	}
	quoted := regexp.QuoteMeta
	jsonSecret, _ := json.Marshal(secret)
	js := strings.Trim(string(jsonSecret), `"`)
	forms := []string{quoted(secret)}
	if q := url.QueryEscape(secret); q != secret {
		forms = append(forms, quoted(q))
	}
	if js != secret {
		forms = append(forms, quoted(js))
	}
	alt := "(?:" + strings.Join(forms, "|") + ")"

	// JSON field: "Password": "secret"
	// (also JSON inside a JSON string, as gofish's collection errors nest it).
	s = regexp.MustCompile(`(?i)("pass(?:word)?\\?"\s*:\s*\\?")`+alt+`(\\?")`).ReplaceAllString(s, `${1}`+redacted+`${2}`)
	// Form field: password=secret, ending at a separator or the end.
	s = regexp.MustCompile(`(?i)\b(pass(?:word)?|pwd?)=`+alt+`([&\s"',;]|$)`).ReplaceAllString(s, `${1}=`+redacted+`${2}`)
	// URL userinfo of any user: //name:secret@
	s = regexp.MustCompile(`(//[^/\s:@]*:)`+alt+`@`).ReplaceAllString(s, `${1}`+redacted+`@`)
	if user != "" {
		// user:secret anywhere (a credential pair echoed back).
		s = regexp.MustCompile(quoted(user)+`:`+alt+`([^\w]|$)`).ReplaceAllString(s, user+":"+redacted+`${1}`)
		// Authorization: Basic base64(user:secret)
		token := base64.StdEncoding.EncodeToString([]byte(user + ":" + secret))
		s = strings.ReplaceAll(s, token, redacted)
	}
	return s
}
