package tcp

import "crypto/x509"

// CertNames are the names a certificate vouches for, as the fabric
// reports them (fabric.Authenticated): the subject's common name, then the
// DNS, URI and e-mail subject alternative names, without repeats.
func CertNames(c *x509.Certificate) []string {
	var names []string
	add := func(n string) {
		if n == "" {
			return
		}
		for _, m := range names {
			if m == n {
				return
			}
		}
		names = append(names, n)
	}
	add(c.Subject.CommonName)
	for _, n := range c.DNSNames {
		add(n)
	}
	for _, u := range c.URIs {
		add(u.String())
	}
	for _, n := range c.EmailAddresses {
		add(n)
	}
	return names
}
