package rtrs

// Work request ids, of both sides (a completion carries its request's
// id back): the kind in the top byte, an index below.
const (
	wrKindShift        = 56
	wrIndexMask        = 1<<wrKindShift - 1
	wrIO        uint64 = 1 << wrKindShift // client request, index = permit
	wrInfoReq   uint64 = 2 << wrKindShift
	wrInfoRsp   uint64 = 3 << wrKindShift
	wrIU        uint64 = 4 << wrKindShift // receive into an IU, index = IU
	wrEmpty     uint64 = 5 << wrKindShift // empty receive
	wrHB        uint64 = 6 << wrKindShift
	wrRsp       uint64 = 7 << wrKindShift // server response, index = msg id
	wrUnbind    uint64 = 8 << wrKindShift // server: a chunk's window unbound, index = msg id
)

func wrKind(id uint64) uint64 { return id &^ wrIndexMask }
