package kube

import (
	"crypto/x509"
	"encoding/pem"
)

type x509Certificate = x509.Certificate

func parsePEMCerts(b []byte) []*x509.Certificate {
	var out []*x509.Certificate
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			return out
		}
		if c, err := x509.ParseCertificate(blk.Bytes); err == nil && blk.Type == "CERTIFICATE" {
			out = append(out, c)
		}
	}
}
